"""`tandem up` scraped by a real Prometheus: the dashboard's p90 TTFT/TPOT queries answer,
every metric the dashboards and rules name is exported, and the tiers' counters agree."""
from __future__ import annotations

import re
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.client import generate, request
from helpers.processes import start_up

REPO = Path(__file__).resolve().parents[2]
TEMPLATE_VALUES = {"job": ".*", "namespace": ".*", "model": ".*", "tier": ".*",
                   "instance": ".*", "worker": ".*", "role": ".*", "datasource": "prometheus",
                   "__rate_interval": "1m", "__interval": "1m", "__range": "1m"}


def fill_template(expr: str) -> str:
    def value(match):
        name = match.group(1) or match.group(2)
        return TEMPLATE_VALUES.get(name, ".*")
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", value, expr)


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        return response.read().decode()


def sample(text: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def up_stack(checkpoint, tmp_path_factory):
    """`tandem up` on the tiny Llama: returns {name: (grpc address, metrics address)}."""
    log_dir = tmp_path_factory.mktemp("up")
    up, processes = start_up(["--model", str(checkpoint("llama").path), "--dtype", "float32"],
                             log_dir)
    assert set(processes) == {"router", "prefill-0", "decode-0"}, \
        (log_dir / "up.log").read_text()[-3000:]
    yield processes
    up.send_signal(signal.SIGTERM)
    assert up.wait(timeout=60) == 0


@pytest.fixture(scope="module")
def prometheus(up_stack, tmp_path_factory):
    from helpers.prometheus import PrometheusServer

    server = PrometheusServer({name: metrics for name, (_, metrics) in up_stack.items()},
                              tmp_path_factory.mktemp("prometheus"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def traffic(up_stack, prometheus):
    """Twelve greedy requests (no stop strings, no early EOS) through the router, sent over a
    few seconds once Prometheus scrapes every tier, so rates over them are not zero."""
    prometheus.wait_for("count(up == 1) == 3", timeout=60)
    router = up_stack["router"][0]
    prompts = [f"request number {i} about the capital of France" for i in range(12)]
    results = []
    for i, prompt in enumerate(prompts):
        results.append(generate(router, request(prompt, max_tokens=8 + i)))
        time.sleep(0.25)
    assert all(r.complete is not None for r in results)
    return results


def test_prometheus_answers_the_dashboard_p90_ttft_and_tpot_queries(prometheus, traffic):
    from helpers.promql_names import expressions_in_deploy

    expressions = [expr for _, expr in expressions_in_deploy(REPO)]
    for metric in ("tandem:time_to_first_token_seconds_bucket",
                   "tandem:request_time_per_output_token_seconds_bucket"):
        p90 = [e for e in expressions if metric in e and "histogram_quantile(0.9" in
               e.replace(" ", "")]
        assert p90, f"the dashboards have no p90 query over {metric}"
        result = prometheus.wait_for(fill_template(p90[0]), timeout=60)
        assert float(result[0]["value"][1]) > 0


def test_every_metric_named_in_deploy_is_exported(up_stack, traffic):
    from helpers.promql_names import (expressions_in_deploy, metric_names,
                                      recording_rule_names)

    exported = set()
    for _, metrics_address in up_stack.values():
        exported |= set(re.findall(r"^(tandem:[A-Za-z0-9_:]+?)(?:\{| )", scrape(metrics_address),
                                   re.M))
    recorded = recording_rule_names(REPO)
    missing = {(source, name) for source, expr in expressions_in_deploy(REPO)
               for name in metric_names(expr) if name not in exported and name not in recorded}
    assert not missing, f"named in deploy/ but not exported by the running services: {missing}"


def test_tier_counters_agree(up_stack, traffic):
    router, prefill, decode = (scrape(up_stack[name][1])
                               for name in ("router", "prefill-0", "decode-0"))
    finished_router = sum(sample(router, "tandem:requests_finished_total", status=s)
                          for s in ("stop", "length"))
    finished_decode = sum(sample(decode, "tandem:requests_finished_total", status=s)
                          for s in ("stop", "length"))
    assert finished_router == finished_decode >= len(traffic)
    assert sample(prefill, "tandem:requests_finished_total", status="pinned") == finished_router
    prompt_router = sample(router, "tandem:prompt_tokens_total")
    prefilled = sample(prefill, "tandem:prompt_tokens_total")
    cache_hits = sample(prefill, "tandem:prefix_cache_hits_total")
    assert prompt_router == prefilled + cache_hits
    assert sample(decode, "tandem:kv_transfer_bytes_total") > 0
    generated_router = sample(router, "tandem:generation_tokens_total")
    generated = sample(prefill, "tandem:generation_tokens_total") + sample(
        decode, "tandem:generation_tokens_total")
    assert generated_router == generated

"""deploy/grafana dashboards and deploy/prometheus rules: every PromQL expression parses and
names only metrics Tandem exports (or the rules record); promtool accepts and passes the rules;
the dashboards import as-is and match their generator."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from helpers.promql_names import (expressions_in_deploy, metric_names, recording_rule_names,
                                  sample_names, undefined_names)
from tandem.common.metrics import BASE_LABELS, RouterMetrics, WorkerMetrics

REPO_ROOT = Path(__file__).resolve().parents[3]
GRAFANA = REPO_ROOT / "deploy" / "grafana"
PROMETHEUS = REPO_ROOT / "deploy" / "prometheus"
DASHBOARDS = ("tandem-overview.json", "tandem-tier.json")
# `$name`, `${name}`, `${name:format}`, `[[name]]`; `$1` (a regex group) is not a variable.
GRAFANA_VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*)(?::\w+)?\}|\$([A-Za-z_]\w*)|\[\[(\w+)\]\]")
# The Accept headers Prometheus scrapes with (2.x; 3.x by default, which allows UTF-8 names).
PROMETHEUS_2_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                       "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
PROMETHEUS_3_ACCEPT = ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
                       "application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;"
                       "escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2")


def metrics_with_every_child() -> tuple[RouterMetrics, WorkerMetrics]:
    """Tandem's metrics, each labelled one given a child so that it has samples to expose."""
    all_metrics = (RouterMetrics("m"), WorkerMetrics("m", "decode"))
    for metrics in all_metrics:
        for value in vars(metrics).values():
            if hasattr(value, "_metric"):  # model/tier bound; status, part, worker, role not yet
                extra = [n for n in value._metric._labelnames if n not in BASE_LABELS]
                value.labels(**dict.fromkeys(extra, "x"))
    return all_metrics


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Sample names Tandem exposes (text format)."""
    expositions = [generate_latest(m.registry).decode() for m in metrics_with_every_child()]
    for text in expositions:  # a labelled metric left without a child would look unexported
        empty = [f.name for f in text_string_to_metric_families(text) if not f.samples]
        assert not empty, f"metrics with no samples: {empty}"
    return set().union(*map(sample_names, expositions))


@pytest.fixture(scope="module")
def dashboards() -> dict[str, dict]:
    return {name: json.loads((GRAFANA / name).read_text()) for name in DASHBOARDS}


def test_expressions_are_found_in_every_file():
    sources = [source.split(":")[0] for source, _ in expressions_in_deploy(REPO_ROOT)]
    for file_name in (*DASHBOARDS, "tandem-rules.yaml"):
        assert sources.count(file_name) >= 10, f"too few expressions found in {file_name}"
    assert "tandem:time_to_first_token_seconds:p90_5m" in recording_rule_names(REPO_ROOT)


def test_every_expression_parses():
    failures = []
    for source, expr in expressions_in_deploy(REPO_ROOT):
        try:
            if not metric_names(expr):
                failures.append(f"{source}: selects no metric\n    {expr}")
        except ValueError as error:  # promql_parser's parse error, or a regex on __name__
            failures.append(f"{source}: {error}\n    {expr}")
    assert not failures, "\n".join(failures)


def test_every_metric_name_is_exported_or_recorded(exported):
    assert not undefined_names(REPO_ROOT, exported)


@pytest.fixture(scope="module")
def metrics_addresses():
    """Router and worker metrics served by Tandem's own `serve`."""
    addresses, servers = [], []
    for metrics in metrics_with_every_child():
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        servers.append(metrics.serve(port, host="127.0.0.1"))
        addresses.append(f"127.0.0.1:{port}")
    yield addresses
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("accept", [PROMETHEUS_2_ACCEPT, PROMETHEUS_3_ACCEPT],
                         ids=["prometheus-2", "prometheus-3"])
def test_a_prometheus_scrape_stores_the_names_deploy_uses(metrics_addresses, accept):
    """prometheus-client's own server answers Prometheus 2.x's OpenMetrics Accept header with
    ':' in sample names turned into '_' (prometheus/client_python#1177): Prometheus would store
    tandem_* and every dashboard would be empty. Tandem's `serve` must keep the names."""
    scraped = set()
    for address in metrics_addresses:
        request = urllib.request.Request(f"http://{address}/metrics", headers={"Accept": accept})
        with urllib.request.urlopen(request, timeout=5) as response:
            scraped |= sample_names(response.read().decode())
    assert not undefined_names(REPO_ROOT, scraped)


def test_recorded_names_do_not_shadow_exported_ones(exported):
    assert not recording_rule_names(REPO_ROOT) & exported


@pytest.mark.parametrize("file_name, old, new", [
    # A histogram renamed in the dashboard but not in metrics.py.
    ("grafana/tandem-overview.json", "tandem:time_to_first_token_seconds_bucket",
     "tandem:time_to_first_token_bucket"),
    # A counter written without the _total prometheus-client adds.
    ("prometheus/tandem-rules.yaml", "tandem:kv_lease_expiries_total",
     "tandem:kv_lease_expiries"),
])
def test_a_renamed_metric_is_detected(exported, tmp_path, file_name, old, new):
    shutil.copytree(REPO_ROOT / "deploy", tmp_path / "deploy")
    path = tmp_path / "deploy" / file_name
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    undefined = undefined_names(tmp_path, exported)
    assert undefined and {name for _, name in undefined} == {new}
    assert all(source.startswith(Path(file_name).name) for source, _ in undefined)


def test_metric_names_ignore_labels_functions_and_variables():
    expr = ('histogram_quantile(0.9, sum by (le, model) (rate(tandem:e2e_request_latency_seconds_'
            'bucket{job=~"$job", status!~"stop|length"}[$__rate_interval]))) '
            '/ on (model) group_left label_replace({__name__="tandem:num_kv_blocks"}, '
            '"a", "$1", "b", "(.*)")')
    assert metric_names(expr) == {"tandem:e2e_request_latency_seconds_bucket",
                                  "tandem:num_kv_blocks"}
    with pytest.raises(ValueError):
        metric_names('{__name__=~"tandem:.*"}')
    with pytest.raises(ValueError):
        metric_names("rate(tandem:prompt_tokens_total[$window])")


def _promtool(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (Debian/Ubuntu: apt-get install prometheus)")
    return subprocess.run(["promtool", *args], cwd=PROMETHEUS, capture_output=True, text=True,
                          timeout=60)


def test_promtool_checks_rules():
    result = _promtool("check", "rules", "tandem-rules.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rule_unit_tests_pass():
    result = _promtool("test", "rules", "tests/tandem-rules.test.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def _panels(panels):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


@pytest.mark.parametrize("name", DASHBOARDS)
def test_dashboard_imports_as_is(dashboards, name):
    board = dashboards[name]
    assert "__inputs" not in board and board["id"] is None
    assert 36 <= board["schemaVersion"] <= 41
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for required in ("job", "namespace", "model", "tier"):
        assert variables[required]["type"] == "query"
        assert variables[required]["query"].startswith("label_values(tandem:")
    for optional_label in ("job", "namespace"):  # All must also match series without the label
        assert variables[optional_label]["includeAll"]
        assert variables[optional_label]["allValue"] == ".*"


@pytest.mark.parametrize("name", DASHBOARDS)
def test_panels_have_unique_ids_and_the_datasource_variable(dashboards, name):
    panels = list(_panels(dashboards[name]["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["id"]
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", (panel["id"], target)
        if panel["type"] != "row":
            assert panel.get("targets"), f"panel {panel['id']} has no query"


@pytest.mark.parametrize("name", DASHBOARDS)
def test_panels_do_not_overlap(dashboards, name):
    cells: dict[tuple[int, int], int] = {}
    for panel in _panels(dashboards[name]["panels"]):
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["id"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"panels {cells[(x, y)]} and {panel['id']} overlap"
                cells[(x, y)] = panel["id"]


@pytest.mark.parametrize("name", DASHBOARDS)
def test_every_variable_used_is_defined(dashboards, name):
    board = dashboards[name]
    defined = {v["name"] for v in board["templating"]["list"]}
    texts = [t["expr"] for p in _panels(board["panels"]) for t in p.get("targets", [])]
    texts += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    texts += [str(p.get("datasource", "")) for p in _panels(board["panels"])]
    used = {next(filter(None, m.groups())) for text in texts
            for m in GRAFANA_VARIABLE.finditer(text)}
    assert {"job", "namespace", "model", "tier", "datasource"} <= used
    assert not {v for v in used - defined if not v.startswith("__")}  # __x: Grafana's own


def test_dashboards_match_their_generator(dashboards):
    spec = importlib.util.spec_from_file_location("build_dashboards",
                                                  GRAFANA / "build_dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    built = module.build()
    assert set(built) == set(DASHBOARDS)
    for name in DASHBOARDS:
        assert built[name] == dashboards[name], (
            f"{name} is stale: run python deploy/grafana/build_dashboards.py")

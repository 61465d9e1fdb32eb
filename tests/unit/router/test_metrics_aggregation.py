"""The summed /metrics page of `tandem router --processes N` and the admission shares."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tandem.common.metrics import RouterMetrics
from tandem.router.metrics_aggregation import sum_pages
from tandem.router.supervisor import share


def page(num_finished: int, ttft: list[float], running: int, healthy: float) -> str:
    metrics = RouterMetrics("m")
    metrics.requests_finished.labels(status="stop").inc(num_finished)
    for seconds in ttft:
        metrics.time_to_first_token.observe(seconds)
    metrics.num_requests_running.set(running)
    metrics.worker_healthy.labels(worker="w:1", role="both").set(healthy)
    return generate_latest(metrics.registry).decode()


def samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def summed(pages: list[str]) -> dict:
    registry = CollectorRegistry()

    class Collector:
        def collect(self):
            return sum_pages(pages)
    registry.register(Collector())
    return samples(generate_latest(registry).decode())


def value(table: dict, name: str, **labels) -> float:
    return next(v for (n, ls), v in table.items()
                if n == name and labels.items() <= dict(ls).items())


def test_counters_histograms_and_gauges_add_up_and_health_takes_the_largest():
    table = summed([page(3, [0.002, 0.3], running=2, healthy=1.0),
                    page(4, [0.002], running=5, healthy=0.0)])
    assert value(table, "tandem:requests_finished_total", status="stop") == 7
    assert value(table, "tandem:time_to_first_token_seconds_count") == 3
    assert value(table, "tandem:time_to_first_token_seconds_bucket", le="0.005") == 2
    assert value(table, "tandem:time_to_first_token_seconds_sum") == 0.304
    assert value(table, "tandem:num_requests_running") == 7
    assert value(table, "tandem:worker_healthy", worker="w:1") == 1.0


def test_one_page_comes_back_unchanged_in_value():
    text = page(2, [0.1], running=1, healthy=1.0)
    assert summed([text]) == samples(text)


def test_shares_add_up_to_the_limit_and_differ_by_at_most_one():
    for total in (1, 7, 256, 1024):
        for num_parts in (1, 2, 3, 8):
            parts = [share(total, num_parts, i) for i in range(num_parts)]
            assert sum(parts) == total and max(parts) - min(parts) <= 1

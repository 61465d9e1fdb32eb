"""One Prometheus page for several router processes: every child's series, summed.

Counters, histogram buckets, sums and counts, and gauges such as requests running or waiting
add up across processes, so the page reads as one router's. Two kinds of series do not:
`tandem:worker_healthy` takes the largest value (1 while any process routes to the worker;
each process checks every worker itself), and the `_created` timestamps the earliest. A child
that is restarting is missing from the sum until it serves again; its counters start from 0,
which Prometheus's rate() reads as a counter reset.
"""
from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

FETCH_TIMEOUT_SECONDS = 2.0
LARGEST_OF = frozenset({"tandem:worker_healthy"})


def fetch_page(url: str) -> str | None:
    """The page at `url`, or None when it cannot be had (a child restarting)."""
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_SECONDS) as response:
            return response.read().decode()
    except OSError:
        return None


def sum_pages(pages: list[str]) -> Iterator[Metric]:
    """The families of `pages` (Prometheus text format), each sample combined across pages."""
    merged: dict[str, tuple[Metric, dict]] = {}
    for page in pages:
        for family in text_string_to_metric_families(page):
            _, samples = merged.setdefault(
                family.name, (Metric(family.name, family.documentation, family.type), {}))
            combine = _combiner(family.name)
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                samples[key] = (sample.value if key not in samples
                                else combine(samples[key], sample.value))
    for metric, samples in merged.values():
        for (name, labels), value in samples.items():
            metric.add_sample(name, dict(labels), value)
        yield metric


def _combiner(family_name: str) -> Callable[[float, float], float]:
    if family_name in LARGEST_OF:
        return max
    if family_name.endswith("_created"):
        return min
    return lambda a, b: a + b


class SummedPages(Collector):
    """A collector (for a CollectorRegistry) of the summed pages at `urls()`."""

    def __init__(self, urls: Callable[[], list[str]]) -> None:
        self._urls = urls

    def collect(self) -> Iterator[Metric]:
        pages = [page for page in map(fetch_page, self._urls()) if page is not None]
        return sum_pages(pages)

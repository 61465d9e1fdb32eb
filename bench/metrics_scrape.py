"""A process's Prometheus /metrics page as samples: how the benchmarks read the counters and
histograms of the stack they drive."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

__all__ = ["scrape"]


def scrape(metrics_address: str, timeout: float = 10.0) -> list[Sample]:
    """Every sample on http://{metrics_address}/metrics now."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=timeout) as reply:
        text = reply.read().decode()
    return [sample for family in text_string_to_metric_families(text)
            for sample in family.samples]

"""PNG charts of benchmark results: latency CDFs and, for a rate sweep, throughput vs latency.

Drawn on a bare matplotlib Figure (Agg canvas), so pyplot's global backend state is never touched
and no display is needed. matplotlib is imported here only; the rest of the benchmark runs
without it.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tandem.bench.report import LATENCY_METRICS, latency_samples

if TYPE_CHECKING:
    from tandem.bench.runner import BenchmarkResult

__all__ = ["plot_results"]


def plot_results(results: Sequence[BenchmarkResult], path: str | Path) -> None:
    """Writes a PNG to `path`: one CDF panel per latency metric (a line per run); with several
    runs (a sweep), two more panels of p50/p90 TTFT and TPOT against output tokens/s."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError(f"--plot needs matplotlib ({exc}); pip install matplotlib") from None
    is_sweep = len(results) > 1
    figure = Figure(figsize=(11, 12 if is_sweep else 8), layout="constrained")
    axes = figure.subplots(3 if is_sweep else 2, 2)
    for ax, (key, label) in zip(axes[:2].flat, LATENCY_METRICS.items()):
        _plot_cdf(ax, key, label, results)
    if is_sweep:
        _plot_curve(axes[2][0], "ttft_s", "TTFT", results)
        _plot_curve(axes[2][1], "tpot_s", "TPOT", results)
    model = results[0].model_info.get("model", "") if results else ""
    figure.suptitle(f"Tandem benchmark: {results[0].config.target}" + (f" ({model})" if model
                                                                         else ""))
    figure.savefig(path, format="png", dpi=100)


def _plot_cdf(ax, key: str, label: str, results: Sequence[BenchmarkResult]) -> None:
    for result in results:
        values = np.sort(np.asarray(latency_samples(result.records)[key])) * 1e3
        if len(values):
            fractions = np.arange(1, len(values) + 1) / len(values)
            ax.step(values, fractions, where="post", label=result.config.load_shape())
    title = f"{label} CDF"
    if key == "itl_s" and results:  # a few long stalls would squash the rest into one line
        p99s = [result.stats[key]["p99"] for result in results if result.stats[key]["p99"]]
        if p99s:
            ax.set_xlim(0, 1.2e3 * max(p99s))  # seconds to ms
            title += " (x axis up to 1.2 x p99)"
    ax.set_title(title)
    ax.set_xlabel(f"{label} (ms)")
    ax.set_ylabel("fraction of " + ("token gaps" if key == "itl_s" else "requests"))
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _plot_curve(ax, key: str, label: str, results: Sequence[BenchmarkResult]) -> None:
    throughputs = [result.stats["output_token_throughput"] or 0.0 for result in results]
    for percentile, marker in (("p50", "o"), ("p90", "s")):
        latencies = [np.nan if result.stats[key][percentile] is None
                     else result.stats[key][percentile] * 1e3 for result in results]
        ax.plot(throughputs, latencies, marker=marker, label=f"{label} {percentile}")
    for result, x in zip(results, throughputs):
        median = result.stats[key]["p50"]
        if median is not None:
            ax.annotate(f"{result.config.rate:g}/s", (x, median * 1e3), fontsize="x-small",
                        textcoords="offset points", xytext=(4, 4))
    ax.set_title(f"{label} vs throughput (labels: offered req/s)")
    ax.set_xlabel("achieved output tokens/s")
    ax.set_ylabel(f"{label} (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")

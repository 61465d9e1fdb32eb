"""Statistics over RequestRecords, goodput, and the fixed-width tables printed at the end.

Only measured (non-warmup) requests count. Latencies (TTFT, TPOT, ITL, e2e) come from successful
requests; percentiles interpolate linearly between order statistics (numpy's default). The
window is the first measured send to the last measured end, errors included; throughputs divide
successful requests and tokens by it. Goodput is successful requests per second that meet every
SLO given: TTFT <= slo_ttft (a request without tokens has no TTFT and misses it) and
TPOT <= slo_tpot (a one-token request has no TPOT and meets it).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from tandem.bench.records import RequestRecord

__all__ = ["LATENCY_METRICS", "compute_stats", "format_sweep_table", "format_table",
           "latency_samples", "summarize"]
PERCENTILES = (50, 90, 99)
# Stats key -> table label.
LATENCY_METRICS = {"ttft_s": "TTFT", "tpot_s": "TPOT", "itl_s": "ITL", "e2e_s": "E2E"}
WIDTH = 64


def summarize(values: Sequence[float]) -> dict:
    """count, mean, p50, p90, p99 and max of `values` (None for each but count when empty)."""
    stats: dict = {"count": len(values)}
    array = np.asarray(values, dtype=np.float64)
    stats["mean"] = float(array.mean()) if len(array) else None
    for p in PERCENTILES:
        stats[f"p{p}"] = float(np.percentile(array, p)) if len(array) else None
    stats["max"] = float(array.max()) if len(array) else None
    return stats


def latency_samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Per-metric samples of the measured, successful requests (ITL: every gap of every one)."""
    ok = [r for r in records if r.is_ok and not r.is_warmup]
    return {
        "ttft_s": [r.ttft_s for r in ok if r.ttft_s is not None],
        "tpot_s": [r.tpot_s for r in ok if r.tpot_s is not None],
        "itl_s": [gap for r in ok for gap in r.itls_s()],
        "e2e_s": [r.e2e_s for r in ok],
    }


def _meets_slo(record: RequestRecord, slo_ttft_s: float | None,
               slo_tpot_s: float | None) -> bool:
    if slo_ttft_s is not None and (record.ttft_s is None or record.ttft_s > slo_ttft_s):
        return False
    return slo_tpot_s is None or record.tpot_s is None or record.tpot_s <= slo_tpot_s


def compute_stats(records: Sequence[RequestRecord], *, slo_ttft_s: float | None = None,
                  slo_tpot_s: float | None = None) -> dict:
    """Counts, throughputs, goodput, errors by gRPC code and latency summaries (seconds)."""
    measured = [r for r in records if not r.is_warmup]
    ok = [r for r in measured if r.is_ok]
    duration_s = 0.0
    if measured:
        end_s = max(r.end_s if r.end_s is not None else r.start_s for r in measured)
        duration_s = end_s - min(r.start_s for r in measured)

    def per_second(amount: float) -> float | None:
        return amount / duration_s if duration_s > 0 else None

    num_prompt_tokens = sum(r.num_prompt_tokens or 0 for r in ok)
    num_cached_tokens = sum(r.num_cached_prompt_tokens or 0 for r in ok)
    ideals = [r.ideal_cached_tokens for r in ok if r.ideal_cached_tokens is not None]
    num_output_tokens = sum(r.num_output_tokens for r in ok)
    goodput = None
    if slo_ttft_s is not None or slo_tpot_s is not None:
        num_good = sum(_meets_slo(r, slo_ttft_s, slo_tpot_s) for r in ok)
        goodput = {"slo_ttft_s": slo_ttft_s, "slo_tpot_s": slo_tpot_s, "num_good": num_good,
                   "requests_per_s": per_second(num_good)}
    stats = {
        "num_requests": len(measured), "num_ok": len(ok), "num_errors": len(measured) - len(ok),
        "num_warmup": len(records) - len(measured),
        "errors": dict(sorted(Counter(r.error_code for r in measured if not r.is_ok).items())),
        "duration_s": duration_s,
        "total_prompt_tokens": num_prompt_tokens, "total_output_tokens": num_output_tokens,
        "total_cached_prompt_tokens": num_cached_tokens,
        "prefix_cache_hit_rate": num_cached_tokens / num_prompt_tokens if num_prompt_tokens
        else None,
        "ideal_cached_prompt_tokens": sum(ideals) if ideals else None,
        "request_throughput": per_second(len(ok)),
        "output_token_throughput": per_second(num_output_tokens),
        "total_token_throughput": per_second(num_prompt_tokens + num_output_tokens),
        "goodput": goodput,
    }
    for key, values in latency_samples(records).items():
        stats[key] = summarize(values)
    return stats


def _num(value: float | None, unit: str = "", scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}{unit}"


def _goodput_line(stats: dict) -> str:
    goodput = stats["goodput"]
    if goodput is None:
        return "n/a (no SLO given: --slo-ttft, --slo-tpot)"
    slos = [f"{name} <= {value * 1e3:g} ms" for name, value in
            (("TTFT", goodput["slo_ttft_s"]), ("TPOT", goodput["slo_tpot_s"]))
            if value is not None]
    return (f"{_num(goodput['requests_per_s'], ' req/s')} ({goodput['num_good']}/"
            f"{stats['num_ok']} met {', '.join(slos)})")


def _hit_rate_line(stats: dict) -> str:
    """Cached / prompt tokens, and the cached tokens against the workload's ideal."""
    rate = stats.get("prefix_cache_hit_rate")
    if rate is None:
        return "n/a"
    line = (f"{rate * 100:.1f}% ({stats['total_cached_prompt_tokens']}/"
            f"{stats['total_prompt_tokens']} prompt tokens cached")
    ideal = stats.get("ideal_cached_prompt_tokens")
    if ideal:
        line += f"; {stats['total_cached_prompt_tokens'] / ideal:.2f}x ideal {ideal}"
    return line + ")"


def format_table(stats: dict, *, router: str, load: str, model: str = "") -> str:
    """The summary of one run, fixed width, latencies in milliseconds."""
    errors = ", ".join(f"{code} {count}" for code, count in stats["errors"].items()) or "none"
    rows = [
        ("Router", f"{router}" + (f" ({model})" if model else "")),
        ("Load", load),
        ("Requests", f"{stats['num_ok']} ok, {stats['num_errors']} failed "
                     f"(+{stats['num_warmup']} warmup)"),
        ("Errors", errors),
        ("Duration", _num(stats["duration_s"], " s")),
        ("Request throughput", _num(stats["request_throughput"], " req/s")),
        ("Output token throughput", _num(stats["output_token_throughput"], " tok/s", digits=1)),
        ("Total token throughput", _num(stats["total_token_throughput"], " tok/s", digits=1)),
        ("Goodput", _goodput_line(stats)),
        ("Prefix cache hit rate", _hit_rate_line(stats)),
    ]
    if "generator" in stats:  # the load generator's own CPU: near 1 core per process, it limits
        generator = stats["generator"]
        rows.append(("Load generator CPU", f"{generator['cpu_cores']:.2f} cores in "
                                           f"{generator['processes']} process(es)"))
    lines = [" Tandem benchmark ".center(WIDTH, "=")]
    lines += [f"{label:<25}{value}" for label, value in rows]
    lines += ["-" * WIDTH, f"{'Latency (ms)':<14}" + "".join(
        f"{name:>10}" for name in ("mean", "p50", "p90", "p99", "max"))]
    for key, label in LATENCY_METRICS.items():
        summary = stats[key]
        lines.append(f"{label:<14}" + "".join(
            f"{_num(summary[name], scale=1e3):>10}" for name in ("mean", "p50", "p90", "p99",
                                                                   "max")))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def format_sweep_table(rates: Sequence[float], stats_list: Sequence[dict]) -> str:
    """One row per rate of a sweep: achieved throughput against p50/p90 TTFT and TPOT (ms)."""
    header = ["rate", "req/s", "out tok/s", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90",
              "goodput", "errors"]
    widths = [8, 9, 11, 10, 10, 10, 10, 9, 8]
    lines = [" Poisson rate sweep (latencies in ms) ".center(sum(widths), "="),
             "".join(f"{h:>{w}}" for h, w in zip(header, widths))]
    for rate, stats in zip(rates, stats_list):
        goodput = stats["goodput"]["requests_per_s"] if stats["goodput"] else None
        cells = [f"{rate:g}", _num(stats["request_throughput"]),
                 _num(stats["output_token_throughput"], digits=1),
                 _num(stats["ttft_s"]["p50"], scale=1e3), _num(stats["ttft_s"]["p90"], scale=1e3),
                 _num(stats["tpot_s"]["p50"], scale=1e3), _num(stats["tpot_s"]["p90"], scale=1e3),
                 _num(goodput), str(stats["num_errors"])]
        lines.append("".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    lines.append("=" * sum(widths))
    return "\n".join(lines)

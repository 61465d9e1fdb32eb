"""bench/disagg.py's numbers and table: one row per run, goodput per layout x mix x SLO, the
ratios, and the time each phase took."""
from __future__ import annotations

import math

from tandem.bench.disagg_sweep import Goodput, RatePoint, goodput, ratio

__all__ = ["format_report", "run_row", "summarize"]
LAYOUTS = ("disaggregated", "aggregated")


def run_row(stats: dict) -> dict:
    """What the table shows of one run's compute_stats: latencies in ms, rates per second."""
    def ms(key: str) -> dict:
        return {p: (None if stats[key][p] is None else stats[key][p] * 1e3)
                for p in ("p50", "p90", "p99")}

    good = stats["goodput"] or {}
    return {"ttft_ms": ms("ttft_s"), "tpot_ms": ms("tpot_s"),
            "request_throughput": stats["request_throughput"],
            "output_token_throughput": stats["output_token_throughput"],
            "num_good": good.get("num_good"), "num_ok": stats["num_ok"],
            "num_errors": stats["num_errors"], "num_requests": stats["num_requests"]}


def _goodput_dict(value: Goodput) -> dict:
    return {"req_per_s": value.value, "kind": value.kind, "passing_rate": value.passing,
            "failing_rate": value.failing, "text": str(value)}


def summarize(runs: list[dict], args) -> dict:
    """Per mix: each layout's goodput and the ratio, for the SLO given and each TPOT of the
    grid (TTFT SLO fixed), all from the same runs."""
    summary = {}
    for mix in dict.fromkeys(r["mix"] for r in runs):
        points = {layout: [RatePoint(r["rate"], r["samples"]) for r in runs
                           if r["mix"] == mix and r["layout"] == layout] for layout in LAYOUTS}
        by_slo = {}
        for tpot in args.tpot_list:
            values = {layout: goodput(points[layout], args.slo_ttft, tpot, args.attainment)
                      for layout in LAYOUTS}
            by_slo[f"{tpot:g}"] = {
                **{layout: _goodput_dict(v) for layout, v in values.items()},
                "ratio": ratio(values["disaggregated"], values["aggregated"])}
        summary[mix] = {"slo_ttft_s": args.slo_ttft, "primary_tpot_s": args.slo_tpot,
                        "by_tpot_slo": by_slo}
    return summary


def _fmt(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def format_report(result: dict) -> str:
    """The fixed-width report: runs, goodput and ratios, phase times."""
    config = result["config"]
    header = (f"{'mix':<14}{'layout':<14}{'rate':>6}{'n':>5}{'SLO met':>8}{'kept up':>8}"
              f"{'TTFT p50':>9}"
              f"{'p90':>7}{'TPOT p50':>9}{'p90':>6}{'p99':>6}{'req/s':>7}{'tok/s':>7}"
              f"{'err':>4}{'router':>7}{'client':>7}{'secs':>6}")
    title = (f" Disaggregated vs aggregated: {result['model']} on {config['devices']}; SLO TTFT "
             f"<= {config['slo_ttft'] * 1e3:g} ms, TPOT <= {config['slo_tpot'] * 1e3:g} ms "
             "(latencies ms) ")
    lines = [title.center(len(header), "="), header]
    mixes = list(dict.fromkeys(r["mix"] for r in result["runs"]))
    order = lambda r: (mixes.index(r["mix"]), LAYOUTS.index(r["layout"]), r["rate"])  # noqa
    for run in sorted(result["runs"], key=order):
        row = run["row"]
        cpu = "n/a" if row.get("router_cpu") is None else f"{row['router_cpu']:.0%}"
        client = "n/a" if row.get("client_cpu") is None else f"{row['client_cpu']:.0%}"
        kept = "n/a" if row.get("kept_up") is None else f"{row['kept_up']:.0%}"
        lines.append(
            f"{run['mix']:<14}{run['layout']:<14}{run['rate']:>6.3g}{row['num_requests']:>5}"
            f"{row['attainment']:>8.0%}{kept:>8}{_fmt(row['ttft_ms']['p50']):>9}"
            f"{_fmt(row['ttft_ms']['p90']):>7}{_fmt(row['tpot_ms']['p50'], 1):>9}"
            f"{_fmt(row['tpot_ms']['p90'], 1):>6}{_fmt(row['tpot_ms']['p99'], 1):>6}"
            f"{_fmt(row['request_throughput'], 2):>7}{_fmt(row['output_token_throughput']):>7}"
            f"{row['num_errors']:>4}{cpu:>7}{client:>7}{row['seconds']:>6.1f}")
    lines.append("-" * len(header))
    target = config.get("attainment", 0.9)
    bias = config["slo_ttft"] / (0.9 * config["run_seconds"]) if config.get("run_seconds") \
        else float("nan")
    lines.append(f"goodput: the highest Poisson rate (req/s) at which >= {target:.0%} of "
                 f"requests meet TTFT <= {config['slo_ttft']:g} s and the TPOT SLO; runs this "
                 f"short overrate a throughput-bound goodput by up to {bias:.0%}")
    lines.append("(interpolated between the last passing and first failing rate; '>=': no "
                 "failing rate reached; '<': the lowest rate failed); kept up: completions / "
                 "arrivals over a run's second half (~1 while keeping pace); router, client: "
                 "CPU share of the router process and of this one (near 100%: the bottleneck)")
    lines.append(f"{'mix':<14}{'TPOT SLO':>9}{'disaggregated':>15}{'aggregated':>12}"
                 f"{'disagg/agg':>12}")
    for mix, summary in result["summary"].items():
        for tpot, entry in summary["by_tpot_slo"].items():
            mark = " <- --slo-tpot" if float(tpot) == summary["primary_tpot_s"] else ""
            lines.append(f"{mix:<14}{float(tpot) * 1e3:>7g}ms"
                         f"{entry['disaggregated']['text']:>15}"
                         f"{entry['aggregated']['text']:>12}{entry['ratio']:>12}{mark}")
    lines.append("-" * len(header))
    total = sum(seconds for _, seconds in result["phases"])
    lines.append(f"phases ({total:.0f} s in all): " + "; ".join(
        f"{name} {seconds:.0f} s" for name, seconds in result["phases"]))
    lines.append("=" * len(header))
    return "\n".join(lines)

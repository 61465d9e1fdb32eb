"""bench/disagg.py: SLO attainment, goodput and the adaptive rate sweep on hand-built runs, the
report, and the whole script end to end on CPU (--cpu-smoke: a tiny transformers-built
checkpoint, real router and worker processes for both layouts)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from tandem.bench.disagg import DEFAULTS, build_parser, layout_workers, resolve
from tandem.bench.disagg_report import format_report, run_row, summarize
from tandem.bench.disagg_sweep import (RatePoint, RateSweep, attainment, goodput, kept_up,
                                       ratio, samples_of)
from tandem.bench.records import RequestRecord
from tandem.bench.report import compute_stats


def record(index, start, token_times, error=None, warmup=False):
    """A finished request whose tokens (one per chunk) arrive at `token_times`."""
    rec = RequestRecord(index=index, start_s=start, num_prompt_tokens=10, error_code=error,
                        is_warmup=warmup)
    for arrival in token_times:
        rec.add_chunk(arrival, 1)
    rec.end_s = (token_times[-1] if token_times else start) + 0.01
    return rec


def test_attainment_counts_successful_requests_meeting_both_slos():
    records = [record(0, 0.0, [0.5, 0.6, 0.7]),  # TTFT 0.5, TPOT 0.1: good
               record(1, 1.0, [2.0, 2.05]),  # TTFT 1.0 exactly: good (inclusive)
               record(2, 2.0, [3.5, 3.6]),  # misses TTFT
               record(3, 3.0, [3.2, 3.4, 3.6]),  # misses TPOT (0.2)
               record(4, 4.0, [4.3]),  # one token: no TPOT, good
               record(5, 5.0, [5.1], error="UNAVAILABLE"),  # failed: a miss
               record(6, 0.0, [9.0], warmup=True)]  # warm-up: not counted
    samples = samples_of(records)
    assert len(samples) == 6
    assert attainment(samples, 1.0, 0.1) == pytest.approx(3 / 6)
    assert attainment(samples, 2.0, 0.2) == pytest.approx(5 / 6)
    assert attainment([], 1.0, 0.1) == 0.0


def point(rate, fraction_good, n=20):
    """A run at `rate` where `fraction_good` of n requests have TPOT 10 ms, the rest 40 ms."""
    good = round(fraction_good * n)
    return RatePoint(rate, [(0.1, 0.01 if i < good else 0.04, True) for i in range(n)])


def test_goodput_interpolates_between_last_pass_and_first_fail():
    runs = [point(4, 1.0), point(8, 0.95), point(12, 0.7), point(16, 0.95)]
    result = goodput(runs, 1.0, 0.02)  # the pass at 16 comes after the first fail: ignored
    assert result.kind == "bracketed" and (result.passing, result.failing) == (8, 12)
    assert result.value == pytest.approx(8 + (0.95 - 0.9) / (0.95 - 0.7) * 4)
    assert goodput(runs, 1.0, 0.05).kind == "at least"  # every run meets a 50 ms TPOT
    assert goodput(runs, 1.0, 0.05).value == 16
    below = goodput([point(4, 0.5)], 1.0, 0.02)
    assert below.kind == "below" and below.value is None and str(below) == "<4.00"
    assert goodput([], 1.0, 0.02).kind == "none"


def test_ratio_marks_bounds():
    bracketed = goodput([point(4, 1.0), point(8, 0.5)], 1.0, 0.02)
    at_least = goodput([point(4, 1.0), point(8, 1.0)], 1.0, 0.02)
    below = goodput([point(4, 0.0)], 1.0, 0.02)
    assert ratio(bracketed, bracketed) == "1.00x"
    assert ratio(at_least, bracketed).startswith(">=")
    assert ratio(bracketed, at_least).startswith("<=")
    assert ratio(below, bracketed).startswith("<")
    assert ratio(bracketed, below).startswith(">")
    not_run = goodput([], 1.0, 0.02)  # one layout only (--layouts)
    assert ratio(not_run, bracketed) == ratio(bracketed, not_run) == "?"


def test_sweep_climbs_until_a_failure_then_refines_once():
    capacity = 20.0  # a fake system: runs pass below this rate
    sweep = RateSweep(start=4, factor=2.0, stop_slo=(1.0, 0.02))
    points, rates = [], []
    while (rate := sweep.next_rate(points)) is not None:
        rates.append(rate)
        points.append(point(rate, 1.0 if rate < capacity else 0.5))
    assert rates == [4, 8, 16, 32, pytest.approx(math.sqrt(16 * 32))]
    result = goodput(points, 1.0, 0.02)
    assert result.passing == 16 and result.failing == pytest.approx(math.sqrt(16 * 32))


def test_sweep_steps_down_when_the_first_rate_fails_and_stops_at_its_floor():
    sweep = RateSweep(start=8, factor=2.0, stop_slo=(1.0, 0.02))
    points, rates = [], []
    while (rate := sweep.next_rate(points)) is not None:
        rates.append(rate)
        points.append(point(rate, 0.0))
    assert rates == [8, 4, 2]


def _args(**overrides):
    args = SimpleNamespace(slo_ttft=1.0, slo_tpot=0.02, tpot_list=[0.02, 0.05],
                           attainment=0.9)
    args.__dict__.update(overrides)
    return args


def _run(layout, mix, rate, fraction_good):
    samples = point(rate, fraction_good).samples
    row = run_row(compute_stats([record(0, 0.0, [0.5, 0.6])], slo_ttft_s=1.0, slo_tpot_s=0.1))
    row.update(attainment=fraction_good, seconds=1.0, router_cpu=0.5, client_cpu=0.2)
    return {"layout": layout, "mix": mix, "rate": rate, "row": row, "samples": samples}


def test_summary_and_report_give_goodput_and_ratio_per_tpot_slo():
    runs = [_run("disaggregated", "prefill-heavy", 4, 1.0),
            _run("disaggregated", "prefill-heavy", 8, 1.0),
            _run("disaggregated", "prefill-heavy", 16, 0.5),
            _run("aggregated", "prefill-heavy", 4, 1.0),
            _run("aggregated", "prefill-heavy", 8, 0.5)]
    args = _args()
    summary = summarize(runs, args)
    entry = summary["prefill-heavy"]["by_tpot_slo"]["0.02"]
    assert entry["disaggregated"]["req_per_s"] == pytest.approx(8 + 0.1 / 0.5 * 8)
    assert entry["aggregated"]["req_per_s"] == pytest.approx(4 + 0.1 / 0.5 * 4)
    assert entry["ratio"] == "2.00x"
    assert summary["prefill-heavy"]["by_tpot_slo"]["0.05"]["ratio"] == "?"  # both ">=" 
    table = format_report({"model": "m", "runs": runs, "summary": summary,
                           "config": {"devices": "cuda:0,cuda:1", "slo_ttft": 1.0,
                                      "slo_tpot": 0.02, "attainment": 0.9},
                           "phases": [("model folder", 1.0), ("disaggregated: start", 20.0)]})
    assert "prefill-heavy      20ms           9.60        4.80       2.00x <- --slo-tpot" in table
    assert "prefill-heavy      50ms        >=16.00      >=8.00           ?" in table
    assert "phases (21 s in all): model folder 1 s; disaggregated: start 20 s" in table
    assert "   50%" in table  # the router's CPU share


def test_layouts_use_the_same_two_devices():
    assert layout_workers("disaggregated", ["cuda:0", "cuda:1"]) == [("prefill", "cuda:0"),
                                                                    ("decode", "cuda:1")]
    assert layout_workers("aggregated", ["cuda:0", "cuda:1"]) == [("both", "cuda:0"),
                                                                 ("both", "cuda:1")]


def test_presets_and_explicit_flags():
    quick = resolve(build_parser().parse_args(["--quick", "--run-seconds", "5"]))
    assert quick.preset == "quick" and quick.run_seconds == 5.0
    assert quick.sweep_seconds == DEFAULTS["quick"]["sweep_seconds"]
    assert quick.tpot_list == [0.01, 0.015, 0.025, 0.05]
    fixed = resolve(build_parser().parse_args(["--prefill-heavy-rates", "2,4",
                                               "--slo-tpot", "0.03"]))
    assert fixed.mix_rates == {"prefill-heavy": [2.0, 4.0], "decode-heavy": None}
    assert 0.03 in fixed.tpot_list
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--quick", "--cpu-smoke"])


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


@pytest.mark.slow
def test_cpu_smoke_sweeps_both_layouts_and_mixes_end_to_end(tmp_path):
    out = tmp_path / "disagg.json"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tandem.bench.disagg", "--cpu-smoke",
                           "--settle-runs", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    cells = {(run["layout"], run["mix"]) for run in result["runs"]}
    assert cells == {(layout, mix) for layout in ("disaggregated", "aggregated")
                     for mix in ("prefill-heavy", "decode-heavy")}
    for run in result["runs"]:
        row = run["row"]
        assert row["num_ok"] + row["num_errors"] == row["num_requests"] >= 4, run
        assert len(run["samples"]) == row["num_requests"]
        assert _finite(row["seconds"]) and 0 <= row["attainment"] <= 1
        if row["num_errors"] == 0:
            # Every request ran to its max_tokens: the smoke mixes' output lengths.
            low, high = (2, 3) if run["mix"] == "prefill-heavy" else (10, 16)
            total = run["stats"]["total_output_tokens"]
            assert row["num_ok"] * low <= total <= row["num_ok"] * high
    for layout in ("disaggregated", "aggregated"):  # the sweep ran more than one rate
        assert len({r["rate"] for r in result["runs"] if r["layout"] == layout}) >= 2
    for mix in ("prefill-heavy", "decode-heavy"):
        assert set(result["summary"][mix]["by_tpot_slo"]) == {"0.01", "0.015", "0.025",
                                                              "0.05"}
    # one uncounted settle run per layout x mix, before the sweeps, not among the runs
    assert proc.stderr.count("settle run, ") == 4, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("=====") and lines[-2].startswith("phases (")
    print(f"cpu smoke took {elapsed:.1f} s")


def test_kept_up_compares_completions_with_arrivals_over_the_second_half():
    steady = [record(i, i * 0.1, [i * 0.1 + 0.05, i * 0.1 + 0.08]) for i in range(40)]
    assert kept_up(steady) == pytest.approx(19 / 21, abs=0.06)  # the last one is in flight
    # Service at half the arrival rate: a queue grows, completions lag.
    behind = [record(i, i * 0.1, [i * 0.2 + 0.05, i * 0.2 + 0.08]) for i in range(40)]
    assert kept_up(behind) < 0.6
    assert kept_up(steady[:5]) is None

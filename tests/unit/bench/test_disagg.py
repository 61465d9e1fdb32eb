"""bench/disagg.py: goodput under an SLO and the disaggregated/aggregated comparison on
hand-built records, and the whole script end to end on CPU (--cpu-smoke: a tiny
transformers-built checkpoint, real router and worker processes for both layouts)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from tandem.bench.disagg import (compare_runs, format_report, goodput_ratio, layout_workers,
                                 run_row)
from tandem.bench.records import RequestRecord
from tandem.bench.report import compute_stats


def record(index, start, token_times, error=None):
    """A finished request whose tokens (one per chunk) arrive at `token_times`."""
    rec = RequestRecord(index=index, start_s=start, num_prompt_tokens=10, error_code=error)
    for arrival in token_times:
        rec.add_chunk(arrival, 1)
    rec.end_s = (token_times[-1] if token_times else start) + 0.01
    return rec


def slo_records():
    """Window 0 .. 9.01 s. SLO TTFT <= 1 s, TPOT <= 0.1 s:
    0: TTFT 0.5, TPOT 0.1 (both exactly met or under)  -> good
    1: TTFT 1.0 exactly, TPOT 0.05                      -> good (the bound is inclusive)
    2: TTFT 1.5                                         -> misses TTFT
    3: TTFT 0.2, TPOT 0.2                               -> misses TPOT
    4: one token, TTFT 0.3 (no TPOT)                    -> good
    5: failed after a fast first token                  -> not counted
    6: TTFT 0.1, TPOT 0.1 exactly, ends last at 9.01    -> good"""
    return [
        record(0, 0.0, [0.5, 0.6, 0.7]),
        record(1, 1.0, [2.0, 2.05, 2.1]),
        record(2, 2.0, [3.5, 3.6]),
        record(3, 3.0, [3.2, 3.4, 3.6]),
        record(4, 4.0, [4.3]),
        record(5, 5.0, [5.1], error="UNAVAILABLE"),
        record(6, 8.7, [8.8, 8.9, 9.0]),
    ]


def test_goodput_counts_requests_meeting_both_slos_over_the_window():
    row = run_row(compute_stats(slo_records(), slo_ttft_s=1.0, slo_tpot_s=0.1))
    assert row["num_good"] == 4 and row["num_ok"] == 6 and row["num_errors"] == 1
    assert row["goodput"] == pytest.approx(4 / 9.01)
    assert row["request_throughput"] == pytest.approx(6 / 9.01)
    assert row["ttft_ms"]["p50"] == pytest.approx(400.0)  # TTFTs 100 200 300 500 1000 1500
    assert row["tpot_ms"]["p50"] == pytest.approx(100.0)  # TPOTs 50 100 100 100 200


def test_a_tighter_slo_lowers_goodput():
    loose = run_row(compute_stats(slo_records(), slo_ttft_s=2.0, slo_tpot_s=0.2))
    tight = run_row(compute_stats(slo_records(), slo_ttft_s=0.4, slo_tpot_s=0.1))
    assert loose["num_good"] == 6  # every successful request
    assert tight["num_good"] == 2  # requests 4 and 6


def test_goodput_ratio():
    assert goodput_ratio(3.0, 2.0) == pytest.approx(1.5)
    assert goodput_ratio(0.0, 2.0) == 0.0
    assert goodput_ratio(1.0, 0.0) is None
    assert goodput_ratio(None, 2.0) is None


def _row(goodput):
    row = run_row(compute_stats(slo_records(), slo_ttft_s=1.0, slo_tpot_s=0.1))
    return {**row, "goodput": goodput}


def test_compare_runs_gives_the_ratio_per_rate_and_at_each_layouts_best_rate():
    runs = [{"layout": "disaggregated", "mix": "prefill-heavy", "rate": 2.0, "row": _row(1.8)},
            {"layout": "aggregated", "mix": "prefill-heavy", "rate": 2.0, "row": _row(1.2)},
            {"layout": "disaggregated", "mix": "prefill-heavy", "rate": 4.0, "row": _row(2.0)},
            {"layout": "aggregated", "mix": "prefill-heavy", "rate": 4.0, "row": _row(0.0)},
            {"layout": "disaggregated", "mix": "decode-heavy", "rate": 4.0, "row": _row(1.0)},
            {"layout": "aggregated", "mix": "decode-heavy", "rate": 4.0, "row": _row(4.0)}]
    comparison = compare_runs(runs)
    prefill = comparison["prefill-heavy"]
    assert prefill["goodput_ratio_by_rate"] == {"2": pytest.approx(1.5), "4": None}
    assert prefill["best_goodput"] == {"disaggregated": 2.0, "aggregated": 1.2}
    assert prefill["goodput_ratio_best"] == pytest.approx(2.0 / 1.2)
    assert comparison["decode-heavy"]["goodput_ratio_best"] == pytest.approx(0.25)
    table = format_report({"model": "m", "config": {"devices": "cuda:0,cuda:1",
                                                     "slo_ttft": 1.0, "slo_tpot": 0.1},
                           "runs": runs, "comparison": comparison})
    assert "prefill-heavy: best rate 1.67x (2 req/s: 1.50x, 4 req/s: n/a)" in table
    assert "decode-heavy: best rate 0.25x" in table


def test_layouts_use_the_same_two_devices():
    assert layout_workers("disaggregated", ["cuda:0", "cuda:1"]) == [("prefill", "cuda:0"),
                                                                    ("decode", "cuda:1")]
    assert layout_workers("aggregated", ["cuda:0", "cuda:1"]) == [("both", "cuda:0"),
                                                                 ("both", "cuda:1")]


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


@pytest.mark.slow
def test_cpu_smoke_runs_both_layouts_and_mixes_end_to_end(tmp_path):
    out = tmp_path / "disagg.json"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tandem.bench.disagg", "--cpu-smoke",
                           "--out", str(out)], capture_output=True, text=True, timeout=240)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    cells = {(run["layout"], run["mix"]) for run in result["runs"]}
    assert cells == {(layout, mix) for layout in ("disaggregated", "aggregated")
                     for mix in ("prefill-heavy", "decode-heavy")}
    for run in result["runs"]:
        row = run["row"]
        assert row["num_errors"] == 0 and row["num_ok"] == 3, run
        for key in ("ttft_ms", "tpot_ms"):
            assert all(_finite(row[key][p]) for p in ("p50", "p90", "p99")), run
        for key in ("request_throughput", "output_token_throughput", "goodput"):
            assert _finite(row[key]) and row[key] > 0, run
        # Every request ran to its max_tokens: the smoke mixes' output lengths.
        low, high = (2, 3) if run["mix"] == "prefill-heavy" else (10, 16)
        assert 3 * low <= run["stats"]["total_output_tokens"] <= 3 * high
    for mix in ("prefill-heavy", "decode-heavy"):
        assert _finite(result["comparison"][mix]["goodput_ratio_best"])
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("=====") and "goodput disaggregated/aggregated" in lines[-2]
    print(f"cpu smoke took {elapsed:.1f} s")  # the brief: < 60 s on an idle 2-core machine

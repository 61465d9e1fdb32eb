"""`python -m tandem.bench.chaos` for a short run on the tiny Llama, so the chaos benchmark
cannot rot: it starts `tandem up`, kills and restarts decode workers under load, and every
check it makes passes (no failed request, outputs equal the offline references, no KV left,
bounded memory growth)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_short_chaos_run_loses_nothing(checkpoint, tmp_path):
    report_path = tmp_path / "chaos.json"
    result = subprocess.run(
        [sys.executable, "-m", "tandem.bench.chaos", "--model", str(checkpoint("llama").path),
         "--prefill", "1", "--decode", "2", "--duration", "14", "--calm-seconds", "3",
         "--kill-every", "7", "--concurrency", "3", "--num-prompts", "6",
         "--max-tokens", "48", "--max-rss-growth", "0.5", "--log-dir", str(tmp_path / "logs"),
         "--json", str(report_path)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-4000:]}"
    report = json.loads(report_path.read_text())
    kills = [k for k in report["kills"] if not k.get("skipped")]
    assert len(kills) >= 2 and all(k["worker"].startswith("decode") for k in kills), report
    assert report["requests"]["chaos"] > 0 and not report["failed"], report
    assert report["mismatched"] == 0 and not report["busy_workers"], report
    # Each kill interrupts a stream on the killed decode worker (3 clients, 2 workers).
    assert report["migrations"] >= 1 and report["router_migrations"] == report["migrations"]

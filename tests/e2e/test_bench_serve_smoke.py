"""bench/serve.py end to end on CPU: the tiny model through `tandem up`, both load runs and
offline LLM.generate of the same requests, so the GPU benchmark cannot rot unseen."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_serve_bench_cpu_smoke_runs_every_phase(tmp_path):
    out = tmp_path / "serve.json"
    done = subprocess.run([sys.executable, "-m", "tandem.bench.serve", "--cpu-smoke",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "served output tok/s, c=4" in done.stdout
    result = json.loads(out.read_text())
    report = result["report"]
    assert report["failed"] == 0
    assert report["kv_blocks"] > 0
    # the offline run generated exactly what the served concurrency run asked for
    served = result["served"]["4"]
    assert result["offline"]["output_tokens"] == sum(
        r["max_tokens"] for r in served["requests"] if not r.get("is_warmup"))
    assert report["served_over_offline"] > 0

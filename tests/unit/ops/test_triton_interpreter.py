"""Our Triton kernels against the torch reference on CPU: tests/interpreted run in a process
started with TRITON_INTERPRET=1 (Triton reads it when a kernel is decorated, so it cannot be
switched on inside this one). Needs triton (the `kernels-cpu` extra); skips without it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]


def test_kernels_match_torch_under_the_triton_interpreter():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(ROOT / "tests" / "interpreted")],
        env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=ROOT, capture_output=True, text=True,
        timeout=900)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0 and "skipped" not in summary, summary

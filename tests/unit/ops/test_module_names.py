"""No GPU kernel module shares its name with the op that dispatches to it (ops/norm.py and
ops/gpu/norm.py read alike in tracebacks and imports): kernel modules are named by what they
hold."""
from __future__ import annotations

from pathlib import Path

OPS = Path(__file__).resolve().parents[3] / "workers" / "ops"


def test_gpu_kernel_modules_do_not_repeat_op_module_names():
    ops = {p.stem for p in OPS.glob("*.py")} - {"__init__"}
    kernels = {p.stem for p in (OPS / "gpu").glob("*.py")} - {"__init__"}
    assert ops and kernels, "ops modules not found: the test lost its subject"
    assert ops & kernels == set()

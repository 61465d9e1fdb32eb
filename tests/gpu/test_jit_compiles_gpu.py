"""The compile watch sees a real Triton compile on the GPU: a kernel variant never compiled
in this process (a fresh constexpr) is reported once, by name, with its duration; launching it
again compiles nothing."""
from __future__ import annotations

import time

import pytest
import torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

import triton.language as tl  # noqa: E402

from tandem.workers.ops.jit_compiles import JitCompileWatch  # noqa: E402


@triton.jit
def _add_constant(x_ptr, n, VALUE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + VALUE, mask=mask)


def test_a_new_variant_is_reported_once_with_its_duration():
    seen = []
    watch = JitCompileWatch(lambda *a: seen.append(a))
    assert watch.install()
    try:
        watch.mark_serving()
        x = torch.zeros(1000, device="cuda")
        value = time.time_ns() % 1000 + 1  # a constexpr this process has not compiled
        for _ in range(2):
            _add_constant[(8,)](x, x.numel(), VALUE=value, BLOCK=128)
        torch.cuda.synchronize()
    finally:
        watch.uninstall()
    assert torch.all(x == 2 * value)
    assert [(name, serving) for name, _, serving in seen] == [("_add_constant", True)]
    assert seen[0][1] > 0

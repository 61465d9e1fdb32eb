"""Programmatic dependent launch (PDL) for our decode-path kernels on Hopper and later.

Without it each kernel of a decode step starts only after the previous one has finished and
its launch has been processed, a gap of a microsecond or two at every kernel boundary, which a
batch-1 step of a few hundred kernels pays hundreds of times. A kernel launched with PDL may
start while the previous kernel is still running; it must execute `gdc_wait()`
(griddepcontrol.wait: the previous grid has completed and its writes are visible) before it
reads anything an earlier kernel wrote and before it writes anything at all. Work that depends
on neither (loading weights, which no kernel writes) may come before the wait.

Invariant kept by every kernel taking USE_PDL: no global store and no load of activations,
KV cache or partial results happens before `wait_for_previous_kernel(USE_PDL)`, except loads of
the previous kernel's own inputs: that kernel launched this one only after its wait, so those
were complete and visible before this one started (moe_decode's down kernel reads the routing
that the gate_up kernel before it reads).
Disabled on ROCm, before sm90, under TRITON_INTERPRET, and with KernelOptions.pdl off
(TANDEM_PDL=0; ops/kernel_options.py).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tandem.workers.ops import kernel_options


@functools.cache
def _pdl_on(device_index: int) -> bool:
    if not kernel_options.current().pdl or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.version.cuda is None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL (launch_pdl=..., USE_PDL=...)."""
    return device.type == "cuda" and _pdl_on(device.index or 0)


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """Wait for the previous kernel, then let the next one launch (it waits in turn)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()

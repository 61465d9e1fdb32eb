"""Small host values (a step's inputs, per-row sampling parameters) onto the device, and
sampled values back, with or without waiting for the device.

A step that runs synchronously (the host reads its tokens before it builds the next step)
copies through pageable memory: `tensor.to("cuda")` waits for the work queued before it, which
has already run. A step queued ahead of the previous one's tokens (asynchronous scheduling,
inside `queued_copies()`) must not wait, so its copies go through pinned memory: they become
ordinary queued operations, the host moves on, and the device reads the values when it reaches
the copy. PyTorch's host allocator keeps each pinned buffer reserved until its copy has run.

Pinned memory only where it buys overlap: pinning per copy slows a GPU that another process
shares (a prefill and a decode worker on the same GPUs) well beyond the copies themselves.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np
import torch

_queued = threading.local()


@contextlib.contextmanager
def queued_copies() -> Iterator[None]:
    """Copies made on this thread inside the block do not wait for the device (a step queued
    ahead); outside it they do. Nests; restored on exit, whatever raised."""
    previous = copies_are_queued()
    _queued.active = True
    try:
        yield
    finally:
        _queued.active = previous


def copies_are_queued() -> bool:
    """Whether this thread is inside `queued_copies()`."""
    return getattr(_queued, "active", False)


def as_device_tensor(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values (a list of numbers, a numpy array or a CPU tensor) as a tensor on device."""
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(values).to(dtype)
    elif isinstance(values, torch.Tensor):
        host = values.to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda" or not copies_are_queued():
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)

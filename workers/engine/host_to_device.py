"""Small host values (a step's inputs, per-row sampling parameters) onto the device without
waiting for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory, and such a copy makes the
host wait until every kernel queued before it has run. Under asynchronous scheduling a step's
inputs are built while the previous step still runs, so that wait would serialize the two.
Staging through pinned memory makes the copy an ordinary queued operation: the host moves on,
and the device reads the values when it reaches the copy. The pinned buffer stays reserved by
PyTorch's host allocator until the copy has run, so it is never overwritten early.
"""
from __future__ import annotations

import numpy as np
import torch


def as_device_tensor(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values (a list of numbers, a numpy array or a CPU tensor) as a tensor on device."""
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(values).to(dtype)
    elif isinstance(values, torch.Tensor):
        host = values.to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)

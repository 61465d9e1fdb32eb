"""Facts about a CUDA device that launch sizes depend on, read once per device."""
from __future__ import annotations

import functools

import torch


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """The device's streaming multiprocessors (compute units on ROCm)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())

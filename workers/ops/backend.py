"""Which kernel library an op runs on. Each op resolves its backend once, at construction."""
from __future__ import annotations

import enum


class KernelBackend(str, enum.Enum):
    TORCH = "torch"  # plain PyTorch: runs anywhere; the reference every other backend is tested against
    AITER_TRITON = "aiter-triton"  # AITER's Triton kernels (CUDA and ROCm); a later issue
    AITER = "aiter"  # AITER native kernels (ROCm); a later issue


KERNEL_CHOICES = ("auto",) + tuple(b.value for b in KernelBackend)


def resolve_backend(name: str, device_type: str) -> KernelBackend:
    """Map the --kernels choice to a backend available on this device.

    `auto` is torch for now: GPU backends land with the GPU-path issue and will be picked here
    when a GPU and amd-aiter are present.
    """
    if name not in KERNEL_CHOICES:
        raise ValueError(f"kernels={name!r} is not one of {', '.join(KERNEL_CHOICES)}")
    if name == "auto":
        return KernelBackend.TORCH
    backend = KernelBackend(name)
    if backend is not KernelBackend.TORCH:
        raise ValueError(f"kernels={name!r} is not available yet on {device_type}; use 'torch'")
    return backend


def require_torch_backend(backend: KernelBackend, op: str) -> KernelBackend:
    """Ops call this at construction until their GPU backends land."""
    if backend is not KernelBackend.TORCH:
        raise ValueError(f"{op}: kernel backend {backend.value!r} is not implemented yet")
    return backend

"""Which kernel library an op runs on. Each op resolves its backend once, at construction.

    --kernels auto          aiter-triton on a GPU when amd-aiter and triton are installed,
                            else torch
    --kernels aiter-triton  GPU only: AITER's Triton ops where they measure faster, our own Triton
                            kernels (workers/ops/gpu/) elsewhere; bench/engine.py prints the choice
    --kernels torch         plain PyTorch, any device: the reference every backend is tested against
"""
from __future__ import annotations

import enum
import functools
import importlib.util

from tandem.common.logging import get_logger
from tandem.workers.ops.aiter_compat import INSTALL_HINT, aiter_available

logger = get_logger(__name__)


class KernelBackend(str, enum.Enum):
    TORCH = "torch"
    AITER_TRITON = "aiter-triton"


KERNEL_CHOICES = ("auto",) + tuple(b.value for b in KernelBackend)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(name: str, device_type: str) -> KernelBackend:
    """Map the --kernels choice to a backend that can run on this device, or say why not."""
    if name not in KERNEL_CHOICES:
        raise ValueError(f"kernels={name!r} is not one of {', '.join(KERNEL_CHOICES)}")
    on_gpu = device_type == "cuda"  # ROCm builds of torch report "cuda" too
    if name == "auto":
        if on_gpu and triton_available() and aiter_available():
            return KernelBackend.AITER_TRITON
        if on_gpu:
            _warn_torch_on_gpu("triton" if not triton_available() else "amd-aiter")
        return KernelBackend.TORCH
    backend = KernelBackend(name)
    if backend is KernelBackend.AITER_TRITON:
        if not on_gpu:
            raise ValueError(f"kernels='aiter-triton' needs a GPU; device is {device_type!r} "
                             "(use 'torch' or 'auto')")
        if not triton_available():
            raise ValueError("kernels='aiter-triton' needs triton (it comes with GPU builds of "
                             "torch)")
        if not aiter_available():
            raise ValueError(f"kernels='aiter-triton' needs amd-aiter: {INSTALL_HINT}")
    return backend


@functools.cache
def _warn_torch_on_gpu(missing: str) -> None:
    """Once per process: a GPU worker on the torch kernels decodes eagerly, without CUDA graphs
    (an 8B model's TPOT ~10x the aiter-triton path's on an H200)."""
    logger.warning("--kernels auto on a GPU: %s is not installed, so the torch kernels run "
                   "(eager decode, no CUDA graphs; several times slower). %s", missing,
                   INSTALL_HINT)

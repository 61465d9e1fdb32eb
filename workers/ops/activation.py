"""Gated activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.workers.ops.backend import KernelBackend


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    def __init__(self, backend: KernelBackend = KernelBackend.TORCH) -> None:
        super().__init__()
        if backend not in (KernelBackend.TORCH, KernelBackend.AITER_TRITON):
            raise ValueError(f"silu_and_mul: kernel backend {backend.value!r} is not implemented")
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        if self.backend is KernelBackend.AITER_TRITON:
            from tandem.workers.ops.gpu.silu_and_mul import silu_and_mul
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

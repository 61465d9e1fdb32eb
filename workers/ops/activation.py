"""Gated activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.workers.ops.backend import KernelBackend, require_torch_backend


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    def __init__(self, backend: KernelBackend = KernelBackend.TORCH) -> None:
        super().__init__()
        self.backend = require_torch_backend(backend, "silu_and_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch
from torch import nn

from tandem.workers.ops.backend import KernelBackend


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6,
                 backend: KernelBackend = KernelBackend.TORCH) -> None:
        super().__init__()
        if backend not in (KernelBackend.TORCH, KernelBackend.AITER_TRITON):
            raise ValueError(f"rms_norm: kernel backend {backend.value!r} is not implemented")
        self.backend = backend
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Same order of operations as transformers: normalize in fp32, cast back, then scale.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: s = x + residual; returns (norm(s), s).

        With residual, x may be [T, n, D]: n terms per row (a mixture-of-experts layer's
        weighted expert outputs, `SparseMoeBlock(summed=False)`), summed to [T, D] first (fp32,
        rounded once to the residual's dtype), or an fp32 [T, D] (their sum, added in fp32 by
        the experts' kernel), rounded to the residual's dtype first.

        On aiter-triton (one fused kernel) s is written into `residual` itself: callers must
        use the returned s and not the residual tensor they passed in.
        """
        if self.backend is KernelBackend.AITER_TRITON:
            from tandem.workers.ops.gpu.add_rms_norm import rms_norm
            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return rms_norm(x, self.weight, self.eps, residual), residual
        if residual is None:
            return self._norm(x)
        if x.dim() == residual.dim() + 1:
            x = x.sum(dim=1, dtype=torch.float32)
        summed = x.to(residual.dtype) + residual
        return self._norm(summed), summed

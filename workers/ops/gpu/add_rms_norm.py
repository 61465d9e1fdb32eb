"""RMSNorm with the residual add fused in: one read of x (and residual), one write of each.

Numerics follow transformers (and rms_norm in ops/norm.py): s = x + residual rounded to the
activation dtype (the new residual), normalized in fp32, rounded, then multiplied by the weight.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o,
                     n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        s = x + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(residual_ptr + row * stride_r + cols, s, mask=mask)  # the new residual
        x = s
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 0) / n_cols + eps)
    normed = (x32 * inv_rms).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] -> norm(x); with residual (same shape, rows contiguous), residual becomes
    x + residual (in place) and the result is norm(x + residual)."""
    if x.dim() != 2:  # e.g. per-head QK norm on [T, H, D]
        if residual is not None:
            raise ValueError("rms_norm with a residual takes [T, D] inputs")
        return rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
    num_rows, n_cols = x.shape
    out = torch.empty_like(x)
    if num_rows == 0:
        return out
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm needs rows with contiguous columns")
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(num_rows,)](
        x, residual if residual is not None else x, weight, out, x.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), n_cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(16, max(1, block // 256)))
    return out

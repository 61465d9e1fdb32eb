"""RMSNorm with the residual add fused in: one read of x (and residual), one write of each.

Numerics follow transformers (and rms_norm in ops/norm.py): s = x + residual rounded to the
activation dtype (the new residual), normalized in fp32, rounded, then multiplied by the weight.

A program normalizes ROWS rows: one for hidden-size rows, several for short ones (Qwen3's
per-head QK norm has rows of head_dim, 128 values), so a program always has a few thousand
values to work on. A [T, H, D] input (q or k viewed out of the fused qkv projection's output)
is read through its own token and head strides, without a copy first.

With a residual, x may also be [T, n, D]: n terms of each row (a mixture-of-experts layer's
weighted expert outputs, one per chosen expert) that the kernel adds up first, in fp32 rounded
once to the activation dtype, as torch's sum over them would. The expert kernels then never
write the summed [T, D] rows, and this kernel never reads them back.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

VALUES_PER_PROGRAM = 2048  # short rows are packed into programs of about this many values


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, num_rows, heads,
                     stride_x_tok, stride_x_head, stride_r, stride_o, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                     TERMS: tl.constexpr):
    """Rows ROWS * pid .. + ROWS of x viewed as [num_rows, n_cols], row r being head r % heads
    of token r // heads (heads = 1 for a 2-D x); out and residual rows are contiguous. With
    TERMS > 1 (heads = 1) row r is the sum of x[r, 0..TERMS-1], stride_x_head apart."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < n_cols)[None, :]
    x_rows = (rows // heads) * stride_x_tok + (rows % heads) * stride_x_head
    x_ptrs = x_ptr + x_rows[:, None] + cols[None, :]
    if TERMS > 1:
        total = tl.zeros([ROWS, BLOCK], tl.float32)
        for term in tl.static_range(TERMS):
            total += tl.load(x_ptrs + term * stride_x_head, mask=mask, other=0.0).to(tl.float32)
        x = total.to(out_ptr.dtype.element_ty)
    else:  # rounded to the activation dtype (out's): x may be a MoE layer's fp32 sum
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(out_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + rows[:, None] * stride_r + cols[None, :]
        s = x + tl.load(r_ptrs, mask=mask, other=0.0)
        tl.store(r_ptrs, s, mask=mask)  # the new residual
        x = s
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 1) / n_cols + eps)
    normed = (x32 * inv_rms[:, None]).to(out_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=cols < n_cols)
    out = normed.to(tl.float32) * w.to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, D] or [T, H, D] (per-head norm; other ranks as their rows) -> norm(x),
    contiguous; with residual ([T, D], rows contiguous), residual becomes x + residual (in
    place) and the result is norm(x + residual), where a [T, n, D] x is first summed over its
    n terms (module docstring), and x may be fp32 in place of the residual's dtype (a MoE
    layer's sum over k, `decode_moe(fp32_sum=True)`: rounded to that dtype before the add).
    x needs a contiguous last dim; its token (and head or term) strides may be anything."""
    terms = 1
    if x.dim() == 3 and residual is not None:  # terms to add up: one row each
        if x.shape[::2] != residual.shape:
            raise ValueError(f"rms_norm: terms {tuple(x.shape)} do not match the residual "
                             f"{tuple(residual.shape)}")
        heads, stride_head, terms = 1, x.stride(1), x.shape[1]
    elif x.dim() == 3:
        heads, stride_head = x.shape[1], x.stride(1)
    elif x.dim() == 2:
        heads, stride_head = 1, 0
    else:  # any other rank: its rows, one after the other
        if residual is not None:
            raise ValueError("rms_norm with a residual takes [T, D] inputs")
        return rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
    if residual is not None and x.dtype not in (residual.dtype, torch.float32):
        raise ValueError(f"rms_norm: x is {x.dtype}, the residual {residual.dtype}: x needs "
                         "the residual's dtype or fp32")
    n_cols = x.shape[-1]
    out = torch.empty(x.shape if residual is None else residual.shape,
                      dtype=x.dtype if residual is None else residual.dtype, device=x.device)
    num_rows = x.shape[0] * heads
    if num_rows == 0:
        return out
    if x.stride(-1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm needs rows with contiguous columns")
    block = triton.next_power_of_2(n_cols)
    rows = max(1, VALUES_PER_PROGRAM // block)
    _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x, residual if residual is not None else x, weight, out, num_rows, heads,
        x.stride(0), stride_head, residual.stride(0) if residual is not None else 0, n_cols,
        n_cols, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, ROWS=rows, TERMS=terms,
        num_warps=min(16, max(1, block * rows // 256)))
    return out

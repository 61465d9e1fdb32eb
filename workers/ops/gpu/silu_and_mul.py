"""silu(gate) * up over x = [gate | up], one launch (torch takes three: chunk views, silu, mul).

Numerics as torch on the activation dtype: silu in fp32 rounded to the dtype, then the product
rounded again.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> [T, I]."""
    num_rows, width = x.shape
    n_cols = width // 2
    out = x.new_empty(num_rows, n_cols)
    if num_rows == 0:
        return out
    if x.stride(1) != 1:
        raise ValueError("silu_and_mul needs rows with contiguous columns")
    block = min(2048, triton.next_power_of_2(n_cols))
    _silu_and_mul_kernel[(num_rows, triton.cdiv(n_cols, block))](
        x, out, x.stride(0), out.stride(0), n_cols, BLOCK=block, num_warps=4)
    return out

"""y = x W^T (+ b) for a handful of rows (decode at small batch): split-K, two launches.

cuBLAS tiles an [M <= 16, K] x [K, N] product over N only; for N = K = 4096 (Llama-8B's o_proj)
that is 64 programs on a 132-SM H100 and the weight streams at ~55% of copy bandwidth. Here
the K dim is cut into SPLIT_K ranges too, each program reads a [BLOCK_N, K / SPLIT_K] slab of
W once, and a second kernel sums the fp32 partials (plus bias) into x's dtype.
bench/engine_ops.py times it against F.linear per shape; `use_skinny_gemm` encodes the result.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16


@triton.jit
def _partial_kernel(x_ptr, w_ptr, part_ptr, M, N, K, stride_xm, stride_wn, k_per_split,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(pid_k * k_per_split, (pid_k + 1) * k_per_split, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    # part [SPLIT_K, M, N] fp32
    tl.store(part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc,
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, stride_om, SPLIT_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + row) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  split_k: int = 4, block_n: int = 64, block_k: int = 128, num_warps: int = 4,
                  num_stages: int = 4) -> torch.Tensor:
    """x [M <= 16, K] (rows contiguous), weight [N, K] contiguous -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"skinny_linear takes <= {MAX_ROWS} rows with contiguous columns")
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    _partial_kernel[(triton.cdiv(n, block_n), split_k)](
        x, weight, part, m, n, k, x.stride(0), weight.stride(0), k_per_split, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    reduce_block = 1024
    _reduce_kernel[(m, triton.cdiv(n, reduce_block))](
        part, bias if bias is not None else part, out, m, n, out.stride(0), SPLIT_K=split_k,
        HAS_BIAS=bias is not None, BLOCK=reduce_block, num_warps=4)
    return out

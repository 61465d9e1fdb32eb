"""y = x W^T for the few rows of a small decode batch, with the ops around it fused in.

At batch 1-8 a decode step is a chain of weight reads (qkv, o, gate_up, down per layer) with
small elementwise kernels between them; on an H200 the launches and the gaps between them were
~0.8 ms of a 4.85 ms 8B step (bench/results/engine-h200.log). One kernel here does

    residual' = x + residual                          (HAS_RESIDUAL; written by program 0)
    h         = rms_norm(residual') * norm_weight       (HAS_NORM)
    y         = h W^T                                   (always)
    act       = silu(y[:, :I]) * y[:, I:]               (SILU_MUL: W = [gate | up], I rows each)

so a layer runs [add+norm+qkv] [attention] [o_proj] [add+norm+gate_up+silu] [down].

Numerics: the RMS statistic is applied after the dot, y = rstd * ((residual' * norm_weight) W^T),
which is the same function as normalizing first; in bf16 it rounds differently from
transformers' order (normalize, round, scale, round) at the level of one bf16 ulp per element
of h. fp32 accumulation throughout; fp32 inputs use IEEE dots (the tests' reference dtype).

One program owns BLOCK_N output columns (both the gate and the up column for SILU_MUL) and reads
its [BLOCK_N, K] slab of W once; every program re-reads x (a few KB, from L2). No split over K,
so no second pass and no partial buffers: the grid is N / BLOCK_N programs.
Each output row m < M is independent; rows are padded to BLOCK_M (16 for the tensor-core dot;
1 takes an elementwise multiply-and-sum path instead).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 8  # above this cuBLAS wins (bench/tune_kernels.py --gemv)


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, w_ptr, out_ptr,
                 M, N, K, up_offset, eps,
                 stride_x, stride_r, stride_ro, stride_w, stride_o,
                 HAS_RESIDUAL: tl.constexpr, HAS_NORM: tl.constexpr, SILU_MUL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    sum_sq = tl.zeros([BLOCK_M], tl.float32)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        mask_mk = mask_m[:, None] & mask_k[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=mask_mk,
                    other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + offs_m[:, None] * stride_r + offs_k[None, :], mask=mask_mk,
                        other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(res_out_ptr + offs_m[:, None] * stride_ro + offs_k[None, :], x,
                     mask=mask_mk & (pid == 0))
        if HAS_NORM:
            xf = x.to(tl.float32)
            sum_sq += tl.sum(xf * xf, 1)
            nw = tl.load(norm_w_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            x = (xf * nw[None, :]).to(x_ptr.dtype.element_ty)
        mask_nk = mask_n[:, None] & mask_k[None, :]
        w = tl.load(w_rows + offs_k[None, :], mask=mask_nk, other=0.0)
        if BLOCK_M == 1:
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), 1)[None, :]
        elif IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
        if SILU_MUL:
            wu = tl.load(w_rows + up_offset * stride_w + offs_k[None, :], mask=mask_nk,
                         other=0.0)
            if BLOCK_M == 1:
                acc_up += tl.sum(wu.to(tl.float32) * x.to(tl.float32), 1)[None, :]
            elif IEEE:
                acc_up += tl.dot(x, tl.trans(wu), input_precision="ieee")
            else:
                acc_up += tl.dot(x, tl.trans(wu))
    if HAS_NORM:
        rstd = tl.rsqrt(sum_sq / K + eps)
        acc = acc * rstd[:, None]
        acc_up = acc_up * rstd[:, None]
    y = acc
    if SILU_MUL:  # on the gate and up values rounded as the unfused path stores them
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + offs_m[:, None] * stride_o + offs_n[None, :],
             y.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def default_config(rows: int, n: int, k: int, silu_mul: bool) -> dict:
    """Launch settings by shape (bench/tune_kernels.py --gemv measures the alternatives)."""
    block_n = 16 if silu_mul or n <= 8192 else 32
    return {"block_n": block_n, "block_k": 512 if rows == 1 else 128, "num_warps": 4,
            "num_stages": 3}


def fused_gemv(x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None,
               norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
               silu_mul: bool = False, config: dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [M <= MAX_ROWS, K], weight [N, K] (row-major) -> (y, new residual or None).

    residual (same shape as x): the add before the norm; its sum is returned as a new tensor
    (not written in place: other programs are still reading the old one). norm_weight [K]:
    RMS-normalize (x + residual) first. silu_mul: weight holds [gate | up] (N even) and y is
    silu(gate) * up, [M, N / 2].
    """
    rows, k = x.shape
    n_total = weight.shape[0]
    if rows > MAX_ROWS or x.stride(1) != 1 or weight.stride(1) != 1 or weight.shape[1] != k:
        raise ValueError(f"fused_gemv takes <= {MAX_ROWS} rows of {weight.shape[1]} contiguous "
                         f"columns, got {tuple(x.shape)}")
    if silu_mul and n_total % 2:
        raise ValueError(f"silu_mul needs [gate | up] rows, got {n_total}")
    n = n_total // 2 if silu_mul else n_total
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if rows == 0:
        return out, res_out
    if residual is not None and residual.stride(1) != 1:
        raise ValueError("fused_gemv needs a residual with contiguous columns")
    cfg = config or default_config(rows, n, k, silu_mul)
    block_m = 1 if rows == 1 else 16
    _gemv_kernel[(triton.cdiv(n, cfg["block_n"]),)](
        x, residual if residual is not None else x, res_out if res_out is not None else x,
        norm_weight if norm_weight is not None else x, weight, out,
        rows, n, k, n if silu_mul else 0, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0,
        res_out.stride(0) if res_out is not None else 0, weight.stride(0), out.stride(0),
        HAS_RESIDUAL=residual is not None, HAS_NORM=norm_weight is not None,
        SILU_MUL=silu_mul, BLOCK_M=block_m, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
        IEEE=x.dtype == torch.float32, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return out, res_out

"""y = x W^T for a single decode row, with the ops around it fused in.

At batch 1 a decode step is a chain of weight reads (qkv, o, gate_up, down per layer) with
small elementwise kernels between them, whose launches and gaps are a large share of an 8B
model's step on an H100 or H200. One kernel here does

    residual' = x + residual                          (HAS_RESIDUAL; written by program 0)
    h         = rms_norm(residual') * norm_weight       (HAS_NORM; WRITE_NORMED: program 0
                                                         also stores h, rounded as RMSNorm)
    y         = h W^T                                   (always)
    act       = silu(y[:I]) * y[I:]                     (SILU_MUL: W = [gate | up], I rows each)

so a layer runs [add+norm+qkv] [rope+KV write+attention] [o_proj] [add+norm+gate_up+silu]
[down] (a mixture-of-experts layer: [add+norm+router, h kept for the experts] [experts...]),
each launched with PDL (pdl.py): the first weight tile is requested before waiting for
the previous kernel, so the weight stream starts while that kernel finishes.

Numerics: the RMS statistic is applied after the dot, y = rstd * ((residual' * norm_weight) W^T),
the same function as normalizing first; in bf16 it rounds differently from transformers' order
(normalize, round, scale, round) by about one bf16 ulp per element of h. fp32 accumulation.

One program owns BLOCK_N output columns (both the gate and the up column for SILU_MUL) and reads
its [BLOCK_N, K] slab of W once, as an elementwise multiply-and-sum (no tensor cores: one row).
Only one row: at 8 rows cuBLAS reads weights much closer to copy bandwidth than a tensor-core
version of this kernel, so batches > 1 use cuBLAS.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.workers.ops.gpu.pdl import pdl_enabled, wait_for_previous_kernel


@triton.jit
def _accumulate(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, k0, K, w, wu, acc, acc_up, sum_sq,
                write_residual, HAS_RESIDUAL: tl.constexpr, HAS_NORM: tl.constexpr,
                SILU_MUL: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    """One BLOCK_K slice of the row: (add, norm-scale) x, then acc += w . x (and acc_up).
    DTYPE is the activation dtype; x is rounded to it first (an fp32 x is a MoE layer's sum)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0).to(DTYPE)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs_k, mask=mask_k, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(DTYPE)
        if write_residual:  # program 0 (a branch: Triton's interpreter takes no scalar masks)
            tl.store(res_out_ptr + offs_k, x, mask=mask_k)
    xf = x.to(tl.float32)
    if HAS_NORM:
        sum_sq += xf * xf
        nw = tl.load(norm_w_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        xf = (xf * nw).to(DTYPE).to(tl.float32)
    acc += tl.sum(w.to(tl.float32) * xf[None, :], 1)
    if SILU_MUL:
        acc_up += tl.sum(wu.to(tl.float32) * xf[None, :], 1)
    return acc, acc_up, sum_sq


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, w_ptr, out_ptr, normed_ptr,
                 N, K, up_offset, eps, stride_w,
                 HAS_RESIDUAL: tl.constexpr, HAS_NORM: tl.constexpr, SILU_MUL: tl.constexpr,
                 WRITE_NORMED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty  # the activation dtype (x may be an fp32 sum)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    up_rows = w_rows + up_offset * stride_w
    offs_k = tl.arange(0, BLOCK_K)
    mask_nk = mask_n[:, None] & (offs_k < K)[None, :]
    # Weights are never written by a kernel: the first tile may load before the wait.
    w = tl.load(w_rows + offs_k[None, :], mask=mask_nk, other=0.0)
    wu = w
    if SILU_MUL:
        wu = tl.load(up_rows + offs_k[None, :], mask=mask_nk, other=0.0)
    wait_for_previous_kernel(USE_PDL)
    acc = tl.zeros([BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_N], tl.float32)
    sum_sq = tl.zeros([BLOCK_K], tl.float32)
    acc, acc_up, sum_sq = _accumulate(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, 0, K, w, wu,
                                      acc, acc_up, sum_sq, pid == 0, HAS_RESIDUAL, HAS_NORM,
                                      SILU_MUL, BLOCK_K, dtype)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_nk = mask_n[:, None] & (offs_k < K)[None, :]
        w = tl.load(w_rows + offs_k[None, :], mask=mask_nk, other=0.0)
        if SILU_MUL:
            wu = tl.load(up_rows + offs_k[None, :], mask=mask_nk, other=0.0)
        acc, acc_up, sum_sq = _accumulate(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, k0, K, w,
                                          wu, acc, acc_up, sum_sq, pid == 0, HAS_RESIDUAL,
                                          HAS_NORM, SILU_MUL, BLOCK_K, dtype)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(sum_sq, 0) / K + eps)
        acc = acc * rstd
        acc_up = acc_up * rstd
        if WRITE_NORMED:  # h for a consumer other than W: normalise, round, scale
            if pid == 0:
                for k0 in range(0, K, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    mask_k = offs_k < K
                    x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0).to(dtype)
                    if HAS_RESIDUAL:  # the inputs, summed as above (neither is written)
                        r = tl.load(res_ptr + offs_k, mask=mask_k, other=0.0)
                        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
                    nw = tl.load(norm_w_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
                    h = (x.to(tl.float32) * rstd).to(dtype).to(tl.float32)
                    tl.store(normed_ptr + offs_k, (h * nw).to(normed_ptr.dtype.element_ty),
                             mask=mask_k)
    y = acc
    if SILU_MUL:  # on the gate and up values rounded as the unfused path stores them
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + offs_n, y.to(dtype), mask=mask_n)


# Launch settings measured best at shapes whose best differs from the general default:
# `python bench/probes/tune_kernels.py --gemv qwen3-30b-a3b` on an H100 (bench/RESULTS.md,
# tune_kernels). Keyed by (output columns, K, silu_mul).
_TUNED = {
    (5120, 2048, False): {"block_n": 4, "block_k": 512, "num_warps": 4, "num_stages": 3},
    (2048, 4096, False): {"block_n": 2, "block_k": 2048, "num_warps": 8, "num_stages": 2},
}
# At most this many output columns (a MoE router's logits): one column per program and whole-K
# slices, so the few columns still spread over many programs.
NARROW_N = 256


def default_config(n: int, k: int, silu_mul: bool) -> dict:
    """Launch settings for an [n (output columns), k] GEMV, from `python
    bench/probes/tune_kernels.py --gemv [MODEL]` (bench/RESULTS.md, tune_kernels):
    - the shapes in _TUNED (Qwen3-30B-A3B's qkv and o) take their measured best;
    - narrow outputs (n <= NARROW_N, a router's logits) one column per program, which at
      Qwen3-30B-A3B's 128x2048 router takes 1.9 us against 2.9 us with 8 columns;
    - everything else the best at Llama-8B's projections on an H100, within a few percent of
      the best on an H200: 1024-wide K slices, 8 warps, 8 output columns per program (4 gate
      + 4 up columns for SILU_MUL)."""
    tuned = _TUNED.get((n, k, silu_mul))
    if tuned is not None:
        return dict(tuned)
    if n <= NARROW_N and not silu_mul:
        return {"block_n": 1, "block_k": min(2048, triton.next_power_of_2(k)), "num_warps": 4,
                "num_stages": 2}
    return {"block_n": 4 if silu_mul else 8, "block_k": 1024, "num_warps": 8,
            "num_stages": 3}


def fused_gemv(x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None,
               norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
               silu_mul: bool = False, normed_out: torch.Tensor | None = None,
               config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [1, K], weight [N, K] (row-major) -> (y [1, N'], new residual or None).

    residual [1, K]: the add before the norm; its sum is returned as a new tensor (not written
    in place: other programs are still reading the old one). With a residual, x may be fp32
    in place of the residual's dtype (a mixture-of-experts layer's sum over k,
    `decode_moe(fp32_sum=True)`): it is rounded to that dtype before the add, and the
    outputs take the residual's dtype. norm_weight [K]: RMS-normalize (x + residual) first.
    silu_mul: weight holds [gate | up] (N even) and y is silu(gate) * up, N' = N / 2.
    normed_out [1, K] (with norm_weight): receives the normalised row as RMSNorm computes it
    (normalise in fp32, round, scale by the weight, round), for a consumer other than this
    weight (the experts beside a router).
    """
    rows, k = x.shape
    n_total = weight.shape[0]
    if rows != 1 or weight.shape[1] != k:
        raise ValueError(f"fused_gemv takes one row of {weight.shape[1]} columns, got "
                         f"{tuple(x.shape)}")
    if silu_mul and n_total % 2:
        raise ValueError(f"silu_mul needs [gate | up] rows, got {n_total}")
    if normed_out is not None and (norm_weight is None or normed_out.shape != x.shape):
        raise ValueError("normed_out needs norm_weight and x's shape")
    if residual is not None and (residual.shape != x.shape or x.dtype not in (
            residual.dtype, torch.float32)):
        raise ValueError(f"fused_gemv: residual {tuple(residual.shape)} {residual.dtype} "
                         f"needs x's shape and x in its dtype or fp32, got {x.dtype}")
    for name, t in (("x", x), ("weight", weight), ("residual", residual),
                    ("normed_out", normed_out)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"fused_gemv needs {name} with contiguous columns")
    dtype = x.dtype if residual is None else residual.dtype
    if normed_out is not None and normed_out.dtype != dtype:
        raise ValueError(f"normed_out is {normed_out.dtype}, the activations {dtype}")
    n = n_total // 2 if silu_mul else n_total
    out = torch.empty(1, n, dtype=dtype, device=x.device)
    res_out = torch.empty_like(residual) if residual is not None else None
    cfg = config or default_config(n, k, silu_mul)
    pdl = pdl_enabled(x.device)
    _gemv_kernel[(triton.cdiv(n, cfg["block_n"]),)](
        x, residual if residual is not None else x, res_out if res_out is not None else x,
        norm_weight if norm_weight is not None else x, weight, out,
        normed_out if normed_out is not None else out, n, k, n if silu_mul else 0, eps,
        weight.stride(0), HAS_RESIDUAL=residual is not None, HAS_NORM=norm_weight is not None,
        SILU_MUL=silu_mul, WRITE_NORMED=normed_out is not None, BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"], USE_PDL=pdl, launch_pdl=pdl, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return out, res_out

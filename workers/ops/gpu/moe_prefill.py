"""Mixture-of-experts for prefill-sized batches: grouped GEMMs over the pairs sorted by expert.

A layer runs as

    [align]     three small launches: per-chunk expert counts, one program for the prefix
                sums (each chunk's first slot per expert, each expert's padded end, the padded
                length), then a stable scatter of the (token, slot) pair ids into sorted_ids
                that also writes each block's expert
    [gate_up]   one program per (BLOCK_M sorted pairs, BLOCK_N of the I columns): the pairs'
                rows of x times the gate rows and the matching up rows of the block's expert
                (one tile of both, one fp32 accumulator), silu(gate) * up stored in sorted
                order [P, I]
    [down]      one program per SM, striding over the (BLOCK_M sorted rows, BLOCK_N of the H
                columns) tiles: those rows of the activation times down, times each pair's
                routing weight, stored per pair [T*k, H]
    [sum over k]  each token's k weighted expert outputs added (torch), or left to the
                caller (terms=True: the next RMSNorm adds them, add_rms_norm.py)

The sorted layout is the one AITER's `fused_moe` reads (moe_aiter.align_by_expert is the
reference): flat pair ids t * k + j, expert by expert in pair order, each expert's run padded
to BLOCK_M with the id T * k, one expert id per block, and the padded length on the device.
Programs walk the blocks in groups of GROUP_SIZE_M block rows so that a group's expert weights
and token rows stay in L2 while every column block uses them.

Expert weights, and the activation (whose rows the gate_up launch stores in sorted order, so a
block's rows are contiguous), are read through Triton tensor descriptors: on Hopper and later
each tile is one TMA copy into shared memory rather than a load per thread, which frees the
warps for the tensor cores (the gathered token rows of x stay per-thread loads). Descriptors
cover row-major views ([E, 2, I, H] for gate and up, [E * H, I], [P, I]), so rows must start
16-byte aligned (`rows_aligned`); a tile reaching past an edge of its view reads zeros, and a
down tile reaching past an expert's H rows reads the next rows of the view into columns that
are never stored.

No host sync and no recompile per token count: the grids are sized on the host from an upper
bound on the padded length (blocks past the device's padded length return at once), and token
and block counts are runtime arguments that Triton does not specialise on, so a call also
captures in a CUDA graph.

Numerics: fp32 accumulation; gate and up are rounded to the activation dtype before
silu(gate) * up, as the unfused path stores them; each weighted expert output is rounded to the
activation dtype before the sum over k (as moe_aiter.py does).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tandem.workers.ops.gpu.device_info import num_sms
from tandem.workers.ops.gpu.moe_decode import dot_precision
from tandem.workers.ops.moe_aiter import check_aiter_triton_args, padded_capacity

# Chunks the align splits the pairs into at most (a chunk is whole tiles of pairs): enough
# programs to count and scatter in parallel, few enough rows of counts for the one-program
# prefix sums to read in one pass.
MAX_CHUNKS = 128
# A tensor descriptor's rows start at multiples of this many bytes (TMA's requirement).
ROW_ALIGN_BYTES = 16


# ---- align: the (token, slot) pairs sorted by expert ------------------------------------------

@triton.jit(do_not_specialize=["num_pairs", "subs"])
def _count_chunk_kernel(ids_ptr, chunk_counts_ptr, num_pairs, subs, BLOCK_E: tl.constexpr,
                        BLOCK_P: tl.constexpr):
    """chunk_counts[c, e] = how many of chunk c's pairs (subs tiles of BLOCK_P) chose e."""
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for sub in range(0, subs):
        pairs = (chunk * subs + sub) * BLOCK_P + tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(chunk_counts_ptr + chunk * BLOCK_E + experts, counts)


@triton.jit(do_not_specialize=["num_chunks"])
def _offsets_kernel(chunk_counts_ptr, chunk_starts_ptr, expert_ends_ptr, num_post_pad_ptr,
                    num_chunks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    """One program. Each expert's run starts at the sum of the padded counts of the experts
    before it (expert_ends[e] = where e's padded run ends); chunk_starts[c, e] = where chunk
    c's first pair of expert e goes (the run's start plus the earlier chunks' pairs of e)."""
    experts = tl.arange(0, BLOCK_E)
    totals = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        chunks = c0 + tl.arange(0, BLOCK_C)
        tile = tl.load(chunk_counts_ptr + chunks[:, None] * BLOCK_E + experts[None, :],
                       mask=(chunks < num_chunks)[:, None], other=0)
        totals += tl.sum(tile, axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_ends = tl.cumsum(padded, axis=0)
    tl.store(num_post_pad_ptr, tl.sum(padded, axis=0))
    tl.store(expert_ends_ptr + experts, padded_ends)
    running = padded_ends - padded
    for c0 in range(0, num_chunks, BLOCK_C):
        chunks = c0 + tl.arange(0, BLOCK_C)
        offsets = chunks[:, None] * BLOCK_E + experts[None, :]
        is_chunk = (chunks < num_chunks)[:, None]
        tile = tl.load(chunk_counts_ptr + offsets, mask=is_chunk, other=0)
        earlier = tl.cumsum(tile, axis=0) - tile
        tl.store(chunk_starts_ptr + offsets, running[None, :] + earlier, mask=is_chunk)
        running += tl.sum(tile, axis=0)


@triton.jit(do_not_specialize=["num_pairs", "subs", "num_chunks", "num_blocks"])
def _scatter_kernel(ids_ptr, chunk_starts_ptr, expert_ends_ptr, sorted_ptr, expert_ids_ptr,
                    num_pairs, subs, num_chunks, num_blocks, NUM_EXPERTS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
                    BLOCK_B: tl.constexpr):
    """Program c: sorted[chunk_starts[c, e] + r] = the id of chunk c's r-th pair that chose
    e, and expert_ids[b] = the expert whose padded run holds block b, for blocks
    [c * BLOCK_B, (c + 1) * BLOCK_B) (the last expert for blocks past the padded length;
    experts past NUM_EXPERTS, BLOCK_E's padding, end at the padded length like the last)."""
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    if chunk < num_chunks:
        starts = tl.load(chunk_starts_ptr + chunk * BLOCK_E + experts)  # next slot per expert
        for sub in range(0, subs):
            pairs = (chunk * subs + sub) * BLOCK_P + tl.arange(0, BLOCK_P)
            is_pair = pairs < num_pairs
            ids = tl.load(ids_ptr + pairs, mask=is_pair, other=-1)
            chose = (ids[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK_P, BLOCK_E]
            # earlier pairs of the same expert in this tile, plus the slot it had reached
            slot = tl.sum((tl.cumsum(chose, axis=0) - 1 + starts[None, :]) * chose, axis=1)
            tl.store(sorted_ptr + slot, pairs, mask=is_pair)
            starts += tl.sum(chose, axis=0)
    blocks = chunk * BLOCK_B + tl.arange(0, BLOCK_B)
    if chunk * BLOCK_B < num_blocks:
        ends = tl.load(expert_ends_ptr + experts)
        ended = ends[None, :] <= (blocks * BLOCK_M)[:, None]
        expert = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), NUM_EXPERTS - 1)
        tl.store(expert_ids_ptr + blocks, expert, mask=blocks < num_blocks)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                    max_chunks: int = MAX_CHUNKS
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_aiter.align_by_expert in three launches, equal outputs. topk_ids [T, k] ->
      sorted_ids [P] int32: flat pair ids (t * k + j), expert by expert; padding = T * k
      expert_ids [P / block_m] int32: the expert of each block of block_m entries
      num_post_pad [1] int32: used length of sorted_ids (a multiple of block_m)
    with P = padded_capacity(T * k, num_experts, block_m). The pairs split into at most
    max_chunks chunks of whole tiles, so the one-program offsets pass reads one row of
    counts per chunk however many tokens there are."""
    ids = topk_ids.reshape(-1)
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.long()
    ids = ids.contiguous()
    num_pairs, device = ids.numel(), ids.device
    capacity = padded_capacity(num_pairs, num_experts, block_m)
    num_blocks = capacity // block_m
    block_e = triton.next_power_of_2(num_experts)
    block_p = max(16, min(256, 16384 // block_e))
    subs = triton.cdiv(triton.cdiv(num_pairs, block_p), max_chunks)
    num_chunks = triton.cdiv(num_pairs, block_p * subs)
    block_b = max(1, 8192 // block_e)
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_post_pad = torch.empty(1, dtype=torch.int32, device=device)
    if num_pairs == 0:
        return sorted_ids, expert_ids, num_post_pad.zero_()
    chunk_counts = torch.empty(num_chunks, block_e, dtype=torch.int32, device=device)
    chunk_starts = torch.empty_like(chunk_counts)
    expert_ends = torch.empty(block_e, dtype=torch.int32, device=device)
    _count_chunk_kernel[(num_chunks,)](ids, chunk_counts, num_pairs, subs, BLOCK_E=block_e,
                                       BLOCK_P=block_p, num_warps=4)
    _offsets_kernel[(1,)](chunk_counts, chunk_starts, expert_ends, num_post_pad, num_chunks,
                          BLOCK_M=block_m, BLOCK_E=block_e,
                          BLOCK_C=max(1, 16384 // block_e), num_warps=8)
    _scatter_kernel[(max(num_chunks, triton.cdiv(num_blocks, block_b)),)](
        ids, chunk_starts, expert_ends, sorted_ids, expert_ids, num_pairs, subs, num_chunks,
        num_blocks, NUM_EXPERTS=num_experts, BLOCK_M=block_m, BLOCK_E=block_e,
        BLOCK_P=block_p, BLOCK_B=block_b, num_warps=4)
    return sorted_ids, expert_ids, num_post_pad


# ---- the grouped GEMMs -----------------------------------------------------------------------

@triton.jit
def _grouped_block(pid, num_blocks_m, num_blocks_n, GROUP_SIZE_M: tl.constexpr):
    """Program pid -> (block row, column block), GROUP_SIZE_M block rows at a time, each
    group's column blocks walked across its rows."""
    per_group = GROUP_SIZE_M * num_blocks_n
    first_m = (pid // per_group) * GROUP_SIZE_M
    group_rows = tl.minimum(num_blocks_m - first_m, GROUP_SIZE_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def _gate_up_silu_kernel(x_ptr, w_desc, act_ptr, sorted_ptr, expert_ids_ptr, num_post_pad_ptr,
                         num_pairs, num_blocks_m, K, I, stride_x, stride_act,
                         TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr,
                         EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """act[r, n] = silu(x[pair // TOP_K] . w[e, n]) * (x[pair // TOP_K] . w[e, I + n]) for one
    block of BLOCK_M sorted rows r (pair = sorted[r], all of expert e; padding rows get 0) and
    BLOCK_N of the I columns. w_desc: w13 as [E, 2, I, K] ([gate; up]), [1, 2, BLOCK_N,
    BLOCK_K] tiles: one copy brings a step's gate and up rows, one dot of 2 * BLOCK_N columns
    multiplies them."""
    pid_m, pid_n = _grouped_block(tl.program_id(0), num_blocks_m, tl.cdiv(I, BLOCK_N),
                                  GROUP_SIZE_M)
    if pid_m * BLOCK_M >= tl.load(num_post_pad_ptr):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + rows)
    is_pair = pairs < num_pairs  # padding slots hold num_pairs
    expert = tl.load(expert_ids_ptr + pid_m)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pairs // TOP_K).to(tl.int64)[:, None] * stride_x + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], tl.float32)  # [gate columns | up columns]
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=is_pair[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs, mask=is_pair[:, None] & (offs_k < K - k0)[None, :], other=0.0)
        # rows past I and columns past K read as zeros
        w = w_desc.load([expert, 0, pid_n * BLOCK_N, k0]).reshape(2 * BLOCK_N, BLOCK_K)
        acc = tl.dot(x, w.T, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
    gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), (0, 2, 1)))
    gate = gate.to(act_ptr.dtype.element_ty).to(tl.float32)
    up = up.to(act_ptr.dtype.element_ty).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * stride_act + offs_n[None, :],
             act.to(act_ptr.dtype.element_ty), mask=(offs_n < I)[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_programs"])
def _down_kernel(act_desc, w_desc, out_ptr, weights_ptr, sorted_ptr, expert_ids_ptr,
                 num_post_pad_ptr, num_pairs, num_programs, K, N, stride_out,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_SIZE_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out[pair, n] = weight[pair] * (act[r] . w[e, n]) for each tile of BLOCK_M sorted rows r
    (pair = sorted[r], all of expert e) and BLOCK_N of the N (hidden) columns. act_desc: the
    sorted activation [P, K], [BLOCK_M, BLOCK_K] tiles; w_desc: w2 as [E * N, K],
    [BLOCK_N, BLOCK_K] tiles.

    Persistent: num_programs programs stride over the tiles of the used blocks (the device's
    padded length), one flattened loop, so a tile's first loads are in flight during the
    previous tile's epilogue; with K only a few BLOCK_Ks deep that epilogue is a large share
    of a tile."""
    num_blocks_n = tl.cdiv(N, BLOCK_N)
    used_blocks_m = tl.load(num_post_pad_ptr) // BLOCK_M
    for tile in tl.range(tl.program_id(0), used_blocks_m * num_blocks_n, num_programs,
                         flatten=True):
        pid_m, pid_n = _grouped_block(tile, used_blocks_m, num_blocks_n, GROUP_SIZE_M)
        expert = tl.load(expert_ids_ptr + pid_m)
        w_row = expert * N + pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = act_desc.load([pid_m * BLOCK_M, k0])  # past K: zeros (in both operands)
            w = w_desc.load([w_row, k0])
            acc = tl.dot(a, w.T, acc, input_precision=DOT_PRECISION)
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        is_pair = pairs < num_pairs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        routing_weight = tl.load(weights_ptr + pairs, mask=is_pair, other=0.0)
        y = acc * routing_weight[:, None]
        tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_out + offs_n[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=is_pair[:, None] & (offs_n < N)[None, :])


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """One grouped GEMM's tile: BLOCK_N output columns (for gate_up, BLOCK_N gate columns and
    the BLOCK_N matching up columns), BLOCK_K of the reduction per step, and the block rows
    walked together (GROUP_SIZE_M)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_size_m: int = 8


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Block rows of block_m sorted pairs (shared by the align and both GEMMs) and each GEMM's
    tile."""

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig


def default_config(num_tokens: int, top_k: int, num_experts: int,
                   element_size: int = 2) -> PrefillConfig:
    """By the mean number of pairs per expert: blocks of rows no taller than an expert's run
    (padding rows cost a full row of work), 128 x 256 output tiles (gate_up: 128 gate and 128
    up columns) once experts have hundreds of rows, gate_up walking 4 block rows at a time
    (`python bench/probes/moe_prefill.py` at Qwen3-30B-A3B's experts). Each stage of the
    128-row tiles holds 48 KiB of shared memory for 2-byte elements, so four stages fit a
    Hopper SM; wider elements (fp32) take a proportionally shorter BLOCK_K to keep each
    stage's bytes."""
    pairs_per_expert = num_tokens * top_k / num_experts
    if pairs_per_expert <= 32:
        config = PrefillConfig(32, GemmConfig(128, 64, 4, 4), GemmConfig(128, 64, 4, 4))
    elif pairs_per_expert <= 128:
        config = PrefillConfig(64, GemmConfig(128, 64, 8, 4), GemmConfig(256, 64, 8, 4))
    else:
        config = PrefillConfig(128, GemmConfig(128, 64, 8, 4, group_size_m=4),
                               GemmConfig(256, 64, 8, 4))
    if element_size <= 2:
        return config
    shrink = element_size // 2
    return dataclasses.replace(
        config,
        gate_up=dataclasses.replace(config.gate_up, block_k=config.gate_up.block_k // shrink),
        down=dataclasses.replace(config.down, block_k=config.down.block_k // shrink))


def rows_aligned(hidden_size: int, intermediate_size: int, element_size: int = 2) -> bool:
    """Whether the kernels' tensor descriptors take experts of this shape: every row of w13,
    w2 and the activation ([*, H] and [*, I]) starts ROW_ALIGN_BYTES-aligned."""
    return (hidden_size * element_size) % ROW_ALIGN_BYTES == 0 \
        and (intermediate_size * element_size) % ROW_ALIGN_BYTES == 0


def _rows_of(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """t (contiguous, any rank) as a 2-D [rows, last dim] descriptor with `block` tiles."""
    return TensorDescriptor.from_tensor(t.view(-1, t.shape[-1]), block)


def gate_up_silu(hidden: torch.Tensor, w13: torch.Tensor, sorted_ids: torch.Tensor,
                 expert_ids: torch.Tensor, num_post_pad: torch.Tensor, top_k: int,
                 block_m: int, tile: GemmConfig) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) of each pair's expert: hidden [T, H], w13 [E, 2I, H]
    (contiguous), the align outputs for block_m -> act [P, I] in sorted order (row r: pair
    sorted_ids[r]; padding rows 0, rows past the padded length unwritten)."""
    num_tokens, hidden_size = hidden.shape
    size = w13.shape[1] // 2
    act = torch.empty(sorted_ids.numel(), size, dtype=hidden.dtype, device=hidden.device)
    num_blocks_m = expert_ids.numel()
    grid = (num_blocks_m * triton.cdiv(size, tile.block_n),)
    w_desc = TensorDescriptor.from_tensor(w13.view(w13.shape[0], 2, size, hidden_size),
                                          [1, 2, tile.block_n, tile.block_k])
    _gate_up_silu_kernel[grid](
        hidden, w_desc, act, sorted_ids, expert_ids, num_post_pad, num_tokens * top_k,
        num_blocks_m, hidden_size, size, hidden.stride(0), act.stride(0), TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, GROUP_SIZE_M=tile.group_size_m,
        EVEN_K=hidden_size % tile.block_k == 0, DOT_PRECISION=dot_precision(hidden.dtype),
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    return act


def down_weighted(act: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
                  num_post_pad: torch.Tensor, block_m: int, tile: GemmConfig) -> torch.Tensor:
    """Each pair's activation through its expert's down projection, times its routing weight:
    act [P, I] in sorted order (gate_up_silu's), w2 [E, H, I] (contiguous), topk_weights
    [T, k] -> [T * k, H] (row t * k + j: token t's j-th expert)."""
    size = act.shape[1]
    num_pairs = topk_weights.numel()
    hidden_size = w2.shape[1]
    weights = topk_weights.reshape(-1).float().contiguous()
    out = torch.empty(num_pairs, hidden_size, dtype=act.dtype, device=act.device)
    tiles = expert_ids.numel() * triton.cdiv(hidden_size, tile.block_n)  # an upper bound
    # one program per SM (a few under the CPU interpreter)
    num_programs = min(tiles, num_sms(act.device) if act.is_cuda else 4)
    _down_kernel[(num_programs,)](
        _rows_of(act, [block_m, tile.block_k]), _rows_of(w2, [tile.block_n, tile.block_k]),
        out, weights, sorted_ids, expert_ids, num_post_pad, num_pairs, num_programs, size,
        hidden_size, out.stride(0), BLOCK_M=block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, GROUP_SIZE_M=tile.group_size_m,
        DOT_PRECISION=dot_precision(act.dtype),
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out


def prefill_fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                      w13_bias: torch.Tensor | None = None,
                      w2_bias: torch.Tensor | None = None, activation: str = "silu",
                      config: PrefillConfig | None = None, terms: bool = False,
                      **_: object) -> torch.Tensor:
    """`moe.torch_fused_moe` on these kernels: align, gate_up with SiLU-and-mul, down, sum.
    With terms the sum is left out: [T, k, H], token t's k weighted expert outputs in slot
    order, for a consumer that adds them up itself (RMSNorm with a residual).

    SiLU only, no biases (the contract of moe_aiter.aiter_triton_fused_moe, which this
    replaces). hidden, w13 and w2 share one dtype; expert weights are contiguous, with
    `rows_aligned` sizes. Any token count; no host sync."""
    check_aiter_triton_args(activation, w13_bias is not None or w2_bias is not None)
    if not (hidden.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"prefill_fused_moe: hidden {hidden.dtype}, w13 {w13.dtype} and w2 "
                         f"{w2.dtype} must share one dtype")
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("prefill_fused_moe needs contiguous expert weights")
    num_tokens, hidden_size = hidden.shape
    if not rows_aligned(hidden_size, w2.shape[2], hidden.element_size()):
        raise ValueError(f"prefill_fused_moe: hidden size {hidden_size} and intermediate size "
                         f"{w2.shape[2]} must be multiples of "
                         f"{ROW_ALIGN_BYTES // hidden.element_size()} for {hidden.dtype}")
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    if num_tokens == 0:
        return hidden.new_zeros((0, top_k, hidden_size) if terms else (0, hidden_size))
    config = config or default_config(num_tokens, top_k, num_experts, hidden.element_size())
    hidden = hidden.contiguous()
    sorted_ids, expert_ids, num_post_pad = align_by_expert(topk_ids, num_experts,
                                                           config.block_m)
    act = gate_up_silu(hidden, w13, sorted_ids, expert_ids, num_post_pad, top_k,
                       config.block_m, config.gate_up)
    pair_out = down_weighted(act, w2, topk_weights, sorted_ids, expert_ids, num_post_pad,
                             config.block_m, config.down)
    pair_out = pair_out.view(num_tokens, top_k, hidden_size)
    if terms:
        return pair_out
    return pair_out[:, 0] if top_k == 1 else pair_out.sum(dim=1)

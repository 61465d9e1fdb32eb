"""Split-KV paged decode attention (flash-decoding), our Triton kernel.

Why ours: AITER's Triton decode kernels launch one program per (KV head, query block), which at
batch 1 x 4k context keeps a handful of SMs busy and reads KV far below copy bandwidth
(bench/RESULTS.md, decode attention). Here every sequence's visible keys are cut into NUM_SPLITS
equal ranges and each (sequence, KV head, split) is one program, so batch 1 still fills the GPU.
The engine runs it above 8 sequences and wherever the whole-block CUDA kernel cannot run
(block_decode.py, which is faster up to 8 sequences on Hopper; ops/attention_gpu.py).

Pass 1 (`_decode_split_kernel`), one program per (seq, kv_head, split):
    the GROUP query heads that share the KV head attend over keys [lo, hi) of their sequence
    (an online softmax over tiles of BLOCK_N keys gathered through the block table) and write
    o_s = sum_j p_j v_j / sum_j p_j   [GROUP, D] fp32,   lse_s = log sum_j exp(s_j)   [GROUP]
    An empty range (short sequence, many splits) writes lse_s = -inf and o_s = 0.
Pass 2, the combine, one per (seq, query head):
    out = sum_s exp(lse_s - m) o_s / (sum_s exp(lse_s - m) + exp(sink - m)),  m = max(lse, sink)
    which is the exact softmax over all visible keys (plus the sink logit, if any).
    The combine is its own launch: folding it into the last split of each (seq, KV head)
    (an atomic arrival counter) is slower at 1 x 4k.

Prefetch (default on): each program loads its first tile before the PDL wait, every key but
the newest, which is the only row of the sequence the previous kernel (RoPE + KV write)
writes; the newest row is loaded after the wait. The KV read then overlaps the previous
kernel's tail (bench/RESULTS.md, decode attention).

Everything the kernels read about the batch lives on the device (seq_lens, block_tables), and
the grid depends only on the batch size: a launch can be captured in a CUDA graph and replayed
for any context lengths. Sliding window W: keys (seq_len - 1 - W, seq_len - 1], as in
attention.py. Cache layout [num_blocks, block_size, kv_heads, head_dim] (attention.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.workers.ops.gpu.pdl import pdl_enabled, wait_for_previous_kernel


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """One tile of an online softmax: s [G, N] scaled scores (-inf where masked, at least one
    visible key), v [N, D]; returns the updated running max m_i, sum l_i and acc [G, D].
    Shared with mla_decode.py, whose scores come from two dots."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _attend_tile(q, k, v, mask_n, m_i, l_i, acc, scale, IEEE: tl.constexpr):
    """One online-softmax step over a tile of keys: returns the updated (m_i, l_i, acc)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(mask_n[None, :], s * scale, float("-inf"))  # [G, N]
    return online_softmax_step(s, v, m_i, l_i, acc, IEEE)


@triton.jit
def _decode_split_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
        part_out_ptr, part_lse_ptr, scale, num_splits,
        stride_q_tok, stride_q_head,
        stride_k_block, stride_k_slot, stride_k_head,
        stride_v_block, stride_v_slot, stride_v_head,
        stride_table,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
        SLIDING_WINDOW: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr,
        PREFETCH: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)

    # Before the PDL wait only what the previous kernel (the KV write) cannot have written:
    # seq_lens and block_tables, filled at least two kernels earlier (attention_gpu.py), and
    # with PREFETCH the first tile's keys except the newest one (written by earlier steps;
    # invariant: a decode step's KV write touches only each sequence's newest row).
    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0
    if SLIDING_WINDOW > 0:
        first = tl.maximum(seq_len - SLIDING_WINDOW, 0)
    # Splits are whole tiles so that only the last tile of a split is ragged.
    per_split = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_d = offs_d < HEAD_DIM
    table = block_tables_ptr + seq * stride_table
    pos = lo + tl.arange(0, BLOCK_N)
    mask_n = pos < hi
    block = tl.load(table + pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    k_ptrs = k_cache_ptr + (block * stride_k_block + (pos % BLOCK_SIZE) * stride_k_slot
                            + kv_head * stride_k_head)[:, None] + offs_d[None, :]
    v_ptrs = v_cache_ptr + (block * stride_v_block + (pos % BLOCK_SIZE) * stride_v_slot
                            + kv_head * stride_v_head)[:, None] + offs_d[None, :]
    if PREFETCH:
        old = (mask_n & (pos < seq_len - 1))[:, None] & mask_d[None, :]
        k = tl.load(k_ptrs, mask=old, other=0.0)
        v = tl.load(v_ptrs, mask=old, other=0.0)
    wait_for_previous_kernel(USE_PDL)  # q and this step's KV come from the previous kernels

    offs_g = tl.arange(0, GROUP_PAD)
    mask_g = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [G, D]
    if PREFETCH:  # the newest key, now written (a masked load: one row at most)
        newest = (mask_n & (pos == seq_len - 1))[:, None] & mask_d[None, :]
        k = tl.where(newest, tl.load(k_ptrs, mask=newest, other=0.0), k)
        v = tl.where(newest, tl.load(v_ptrs, mask=newest, other=0.0), v)
    else:
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    if lo < hi:
        m_i, l_i, acc = _attend_tile(q, k, v, mask_n, m_i, l_i, acc, scale, IEEE)
    next_pos = pos + BLOCK_N
    block = tl.load(table + next_pos // BLOCK_SIZE, mask=next_pos < hi, other=0).to(tl.int64)
    for start in range(lo + BLOCK_N, hi, BLOCK_N):  # `block`: this tile's ids, loaded ahead
        pos = start + tl.arange(0, BLOCK_N)
        mask_n = pos < hi
        slot_in_block = pos % BLOCK_SIZE
        k_off = block * stride_k_block + slot_in_block * stride_k_slot + kv_head * stride_k_head
        v_off = block * stride_v_block + slot_in_block * stride_v_slot + kv_head * stride_v_head
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, mask_n, m_i, l_i, acc, scale, IEEE)
        next_pos = pos + BLOCK_N
        block = tl.load(table + next_pos // BLOCK_SIZE, mask=next_pos < hi,
                        other=0).to(tl.int64)

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    # part_out [B, H, NUM_SPLITS, HEAD_DIM_PAD], part_lse [B, H, NUM_SPLITS], contiguous.
    row = (seq * num_kv_heads * GROUP + heads) * num_splits + split  # [G]
    tl.store(part_out_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :], out,
             mask=mask_g[:, None])
    tl.store(part_lse_ptr + row, lse, mask=mask_g)


@triton.jit
def _combine_splits_kernel(
        part_out_ptr, part_lse_ptr, sinks_ptr, out_ptr, stride_out_tok, stride_out_head,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
        CHUNK_D: tl.constexpr, HAS_SINKS: tl.constexpr, USE_PDL: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    wait_for_previous_kernel(USE_PDL)
    num_heads = tl.num_programs(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.program_id(2) * CHUNK_D + tl.arange(0, CHUNK_D)
    row = (seq * num_heads + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + row + offs_s)  # [S]
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)  # no keys at all (a 0-length row): weights 0
    weights = tl.exp(lse - m)  # empty splits: exp(-inf) = 0
    denom = tl.sum(weights, 0)
    if HAS_SINKS:
        denom += tl.exp(sink - m)
    denom = tl.where(denom > 0, denom, 1.0)
    parts = tl.load(part_out_ptr + (row + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :])
    out = tl.sum(parts * weights[:, None], 0) / denom
    tl.store(out_ptr + seq * stride_out_tok + head * stride_out_head + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def combine_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                   sinks: torch.Tensor | None = None) -> None:
    """out[b, h] = the softmax-weighted sum of the splits' partial outputs (module docstring).

    part_out [B, H, S, D_pad] fp32, part_lse [B, H, S] fp32 (contiguous), out [B, H, D] with a
    contiguous last dim; sinks [H] or None. Columns are combined in chunks of at most 128 (one
    chunk for a 128-wide head; MLA's 512-wide latent takes four programs per head).
    """
    num_seqs, num_heads, num_splits, width_pad = part_out.shape
    chunk = min(width_pad, 128)
    _combine_splits_kernel[(num_seqs, num_heads, width_pad // chunk)](
        part_out, part_lse, sinks if sinks is not None else part_lse, out,
        out.stride(0), out.stride(1), HEAD_DIM=out.shape[-1], HEAD_DIM_PAD=width_pad,
        NUM_SPLITS=num_splits, CHUNK_D=chunk, HAS_SINKS=sinks is not None,
        USE_PDL=pdl_enabled(out.device), launch_pdl=pdl_enabled(out.device),
        num_warps=4 if chunk >= 128 else 1)


def num_splits_for(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                   block_n: int = 64) -> int:
    """Splits per sequence: enough programs for ~2 waves over the SMs, never a split shorter
    than one tile, a power of two (the combine kernel's arange), at most 64.

    It depends only on the batch shape and the longest context the launch must serve, so a
    CUDA graph captured for a batch size keeps a valid choice at every context length.
    """
    wanted = max(1, (2 * num_sms) // max(1, num_seqs * num_kv_heads))
    useful = max(1, -(-max_seq_len // block_n))
    splits = min(wanted, useful, 64)
    return 1 << (splits.bit_length() - 1)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           num_splits: int, out: torch.Tensor | None = None,
                           sliding_window: int | None = None,
                           sinks: torch.Tensor | None = None, block_n: int = 64,
                           num_warps: int = 4, num_stages: int | None = None,
                           prefetch: bool = True) -> torch.Tensor:
    """One query token per sequence: q [B, H, D] -> out [B, H, D] (q's dtype).

    block_tables [B, max_blocks] int32, seq_lens [B] int32 (keys in the cache, the new token's
    included). num_splits: a power of two (see num_splits_for). Launch defaults, the best of
    `python bench/probes/tune_kernels.py` and bench/engine.py on an H100: 64-key tiles,
    4 warps, 3 pipeline stages for a single split (one program loops over many tiles), else 2.
    """
    if num_stages is None:
        num_stages = 3 if num_splits == 1 else 2
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits={num_splits} must be a power of two")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("q and the KV caches need a contiguous head_dim")
    group = num_heads // num_kv_heads
    head_dim_pad = triton.next_power_of_2(head_dim)
    if out is None:
        out = torch.empty_like(q)
    part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim_pad, dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    pdl = pdl_enabled(q.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse, scale, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        SLIDING_WINDOW=sliding_window or 0,
        IEEE=q.dtype == torch.float32, USE_PDL=pdl, launch_pdl=pdl,
        PREFETCH=prefetch, num_warps=num_warps, num_stages=num_stages)
    combine_splits(part_out, part_lse, out, sinks)
    return out


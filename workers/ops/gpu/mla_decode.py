"""Split-KV paged MLA decode (absorbed form) and the latent-cache write, our Triton kernels.

MLA decode after absorbing the up-projections (ops/mla.py) is multi-query attention with one
"KV head" whose keys are whole latent rows and whose values are their first R entries:

    q_lat [B, H, R], q_pe [B, H, P]          per sequence and query head (R = kv_lora_rank,
                                              P = qk_rope_head_dim)
    cache [num_blocks, block_size, 1, R + P]  row = [c | k_pe] of one token
    s_j   = scale * (q_lat . c_j + q_pe . k_pe_j)
    out   = sum_j softmax_j(s) c_j            -> [B, H, R]  (the caller applies W_UV)

Pass 1 (`_mla_split_kernel`), one program per (seq, head block of BLOCK_H heads, split): the
heads of the block attend over keys [lo, hi) of the sequence, an online softmax over tiles of
BLOCK_N latent rows gathered through the block table. Each tile is loaded once, as its latent
part [BLOCK_N, R] and its rope part [BLOCK_N, P], and serves both dots: the scores (two dots,
latent and rope chunk: R + P = 576 is no power of two) and the value update (latent only).
Register use is bounded by the head block, not by H: q [BLOCK_H, R + P] and the accumulator
[BLOCK_H, R] fp32 (16 x 512: 32 KiB per program); H = 128 is 8 head blocks that read the same
tiles (from L2 after the first). Writes, per head, o_s [R] fp32 and lse_s (-inf, o_s = 0 for an
empty range).
Pass 2: paged_decode.combine_splits (the same combine as dense decode), one program per (seq,
head, chunk of 128 columns): out = sum_s exp(lse_s - m) o_s / sum_s exp(lse_s - m), the exact
softmax over all keys; the chunks keep a [splits, 128] tile in registers whatever R is.

Graph-safe, as paged_decode.py: seq_lens and block tables are read on the device only, the
grid depends only on the batch size (and the split count, chosen from max_seq_len, which a
graph captures at max_model_len). A CUDA-graph padding row (seq_len 1, block-table row of
zeros) reads row 0 of block 0 and its output is dropped by the caller; a row with seq_len 0
yields zeros, not NaN.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.workers.ops.gpu.kv_write import slot_offset
from tandem.workers.ops.gpu.paged_decode import (combine_splits, num_splits_for,
                                                 online_softmax_step)

__all__ = ["mla_decode_attention", "mla_num_splits", "write_latent_cache"]


@triton.jit
def _mla_split_kernel(
        q_lat_ptr, q_pe_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr,
        part_out_ptr, part_lse_ptr, scale, num_heads, num_splits,
        stride_ql_tok, stride_ql_head, stride_qp_tok, stride_qp_head,
        stride_cache_block, stride_cache_slot, stride_table,
        BLOCK_SIZE: tl.constexpr, LORA_RANK: tl.constexpr, LORA_PAD: tl.constexpr,
        ROPE_DIM: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # Splits are whole tiles so that only the last tile of a split is ragged.
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < num_heads
    offs_r = tl.arange(0, LORA_PAD)
    offs_p = tl.arange(0, ROPE_PAD)
    mask_r = offs_r < LORA_RANK
    mask_p = offs_p < ROPE_DIM
    q_lat = tl.load(q_lat_ptr + seq * stride_ql_tok + heads[:, None] * stride_ql_head
                    + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + seq * stride_qp_tok + heads[:, None] * stride_qp_head
                   + offs_p[None, :], mask=mask_h[:, None] & mask_p[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LORA_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_table
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        mask_n = pos < hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        row = cache_ptr + block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot
        latent = tl.load(row[:, None] + offs_r[None, :],
                         mask=mask_n[:, None] & mask_r[None, :], other=0.0)  # [N, R]
        rope = tl.load(row[:, None] + LORA_RANK + offs_p[None, :],
                       mask=mask_n[:, None] & mask_p[None, :], other=0.0)  # [N, P]
        if IEEE:
            s = tl.dot(q_lat, tl.trans(latent), input_precision="ieee")
            s += tl.dot(q_pe, tl.trans(rope), input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(latent))
            s += tl.dot(q_pe, tl.trans(rope))
        s = tl.where(mask_n[None, :], s * scale, float("-inf"))  # [H_blk, N]
        m_i, l_i, acc = online_softmax_step(s, latent, m_i, l_i, acc, IEEE)

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    # part_out [B, H, num_splits, LORA_PAD], part_lse [B, H, num_splits], contiguous.
    part_row = (seq * num_heads + heads) * num_splits + split  # [H_blk]
    tl.store(part_out_ptr + part_row[:, None] * LORA_PAD + offs_r[None, :], out,
             mask=mask_h[:, None])
    tl.store(part_lse_ptr + part_row, lse, mask=mask_h)


def _pad(n: int) -> int:
    """tl.dot needs every dimension >= 16; arange needs powers of two."""
    return max(16, triton.next_power_of_2(n))


def mla_num_splits(num_seqs: int, num_heads: int, max_seq_len: int, num_sms: int,
                   block_h: int = 16, block_n: int = 32) -> int:
    """Splits per sequence for `mla_decode_attention` (paged_decode.num_splits_for with head
    blocks in place of KV heads): a power of two, fixed by the batch shape and max_seq_len."""
    return num_splits_for(num_seqs, triton.cdiv(num_heads, block_h), max_seq_len, num_sms,
                          block_n)


def mla_decode_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                         num_splits: int, out: torch.Tensor | None = None, block_h: int = 16,
                         block_n: int | None = None, num_warps: int = 4,
                         num_stages: int | None = None) -> torch.Tensor:
    """One query per sequence: q_lat [B, H, R], q_pe [B, H, P] -> out [B, H, R] (q_lat's dtype).

    latent_cache [num_blocks, block_size, 1, R + P]; block_tables [B, max_blocks] int32;
    seq_lens [B] int32 (rows in the cache, the new token's included). q tensors need a
    contiguous last dim (any token / head strides: views of a bmm output are fine).
    num_splits: a power of two (`mla_num_splits`). Tiles: 32 rows (16 in fp32, whose tiles are
    twice the bytes and whose dots run in IEEE fp32); not tuned on a GPU yet.
    """
    num_seqs, num_heads, lora_rank = q_lat.shape
    _, block_size, one, latent_dim = latent_cache.shape
    rope_dim = latent_dim - lora_rank
    if one != 1 or rope_dim <= 0 or tuple(q_pe.shape) != (num_seqs, num_heads, rope_dim):
        raise ValueError(f"q_lat {tuple(q_lat.shape)}, q_pe {tuple(q_pe.shape)} and latent cache "
                         f"{tuple(latent_cache.shape)} do not fit [B, H, R], [B, H, P], "
                         "[blocks, block_size, 1, R + P]")
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits={num_splits} must be a power of two")
    if q_lat.stride(2) != 1 or q_pe.stride(2) != 1 or latent_cache.stride(3) != 1:
        raise ValueError("q_lat, q_pe and the latent cache need a contiguous last dim")
    ieee = q_lat.dtype == torch.float32
    if block_n is None:
        block_n = 16 if ieee else 32
    if num_stages is None:
        num_stages = 1 if ieee else 2
    lora_pad, block_h = _pad(lora_rank), _pad(block_h)
    if out is None:
        out = q_lat.new_empty(num_seqs, num_heads, lora_rank)
    part_out = torch.empty(num_seqs, num_heads, num_splits, lora_pad, dtype=torch.float32,
                           device=q_lat.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                           device=q_lat.device)
    if num_seqs == 0:
        return out
    _mla_split_kernel[(num_seqs, triton.cdiv(num_heads, block_h), num_splits)](
        q_lat, q_pe, latent_cache, block_tables, seq_lens, part_out, part_lse, scale,
        num_heads, num_splits, q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0),
        BLOCK_SIZE=block_size, LORA_RANK=lora_rank, LORA_PAD=lora_pad, ROPE_DIM=rope_dim,
        ROPE_PAD=_pad(rope_dim), BLOCK_H=block_h, BLOCK_N=block_n, IEEE=ieee,
        num_warps=num_warps, num_stages=num_stages)
    combine_splits(part_out, part_lse, out)
    return out


@triton.jit
def _write_latent_kernel(kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, stride_c_tok, stride_pe_tok,
                         stride_cache_block, stride_cache_slot, BLOCK_SIZE: tl.constexpr,
                         LORA_RANK: tl.constexpr, LORA_PAD: tl.constexpr,
                         ROPE_DIM: tl.constexpr, ROPE_PAD: tl.constexpr):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:  # negative: a CUDA-graph padding row, which writes nothing
        offs_r = tl.arange(0, LORA_PAD)
        offs_p = tl.arange(0, ROPE_PAD)
        mask_r = offs_r < LORA_RANK
        mask_p = offs_p < ROPE_DIM
        c = tl.load(kv_c_ptr + tok * stride_c_tok + offs_r, mask=mask_r)
        pe = tl.load(k_pe_ptr + tok * stride_pe_tok + offs_p, mask=mask_p)
        row = cache_ptr + slot_offset(slot, BLOCK_SIZE, stride_cache_block, stride_cache_slot)
        tl.store(row + offs_r, c.to(cache_ptr.dtype.element_ty), mask=mask_r)
        tl.store(row + LORA_RANK + offs_p, pe.to(cache_ptr.dtype.element_ty), mask=mask_p)


def write_latent_cache(kv_c: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Row slot_mapping[t] of the cache becomes [kv_c[t] | k_pe[t]] (cast to the cache dtype);
    negative slots (padding rows of a CUDA-graph batch) write nothing. kv_c [T, R], k_pe
    [T, P], each with a contiguous last dim; one program per token."""
    num_tokens, lora_rank = kv_c.shape
    rope_dim = k_pe.shape[-1]
    if num_tokens == 0:
        return
    if lora_rank + rope_dim != latent_cache.shape[-1]:
        raise ValueError(f"kv_c [.., {lora_rank}] + k_pe [.., {rope_dim}] do not fill a latent "
                         f"row of {latent_cache.shape[-1]}")
    if kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1:
        raise ValueError("kv_c and k_pe need a contiguous last dim")
    _write_latent_kernel[(num_tokens,)](
        kv_c, k_pe, latent_cache, slot_mapping, kv_c.stride(0), k_pe.stride(0),
        latent_cache.stride(0), latent_cache.stride(1), BLOCK_SIZE=latent_cache.shape[1],
        LORA_RANK=lora_rank, LORA_PAD=triton.next_power_of_2(lora_rank), ROPE_DIM=rope_dim,
        ROPE_PAD=triton.next_power_of_2(rope_dim), num_warps=4)

"""RoPE on q and k in place, one launch for both (one program per token, all its heads).

Same function as rotary.RotaryEmbedding (cos/sin tables [max_position, rotary_dim / 2] fp32,
already multiplied by the attention factor; the first rotary_dim dims of each head rotate, the
rest pass through untouched), computed in fp32 and rounded once to the activation dtype.
Pairs: neox style (x[i], x[i + R/2]); GPT-J style (x[2i], x[2i + 1]).

With a KV cache (rope_and_write_kv) the same launch also writes the rotated K and V rows into
the paged cache at slot_mapping[t] (skipped for padding slots < 0, as kv_cache.write_kv_cache):
one kernel instead of two per layer. The rotated K values are stored from registers to both
k (in place) and the cache, so no thread reads back another thread's store.

With qk_norm = (q weight, k weight, eps) the launch first applies a per-head RMSNorm to q and k
(Qwen3's and GLM-4.5's QK norm) in the order norm.RMSNorm uses: normalise in fp32, round to the
activation dtype, multiply by the weight and round again; RoPE then reads those rounded
values, as it would read the norm's output tensor. Full rotary only (every dimension of a head
is in one of the rotated pairs, so the pairs' sums of squares are the head's).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.workers.ops.gpu.kv_write import slot_offset
from tandem.workers.ops.gpu.pdl import pdl_enabled, wait_for_previous_kernel


@triton.jit
def _rotate_heads(x_ptr, stride_head, num_heads, cos, sin,
                  HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                  NEOX: tl.constexpr, cache_ptr, stride_cache_head, TO_CACHE: tl.constexpr,
                  norm_w_ptr, eps, NORM: tl.constexpr):
    offs_h = tl.arange(0, HEADS_PAD)
    offs_i = tl.arange(0, HALF_PAD)
    mask = (offs_h[:, None] < num_heads) & (offs_i[None, :] < HALF)
    if NEOX:
        first = offs_i
        second = offs_i + HALF
    else:
        first = 2 * offs_i
        second = 2 * offs_i + 1
    p1 = x_ptr + offs_h[:, None] * stride_head + first[None, :]
    p2 = x_ptr + offs_h[:, None] * stride_head + second[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # per-head RMSNorm over the 2 * HALF dims (full rotary), rounded as RMSNorm does
        dtype = x_ptr.dtype.element_ty
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
                       + eps)[:, None]
        w1 = tl.load(norm_w_ptr + first, mask=offs_i < HALF).to(tl.float32)[None, :]
        w2 = tl.load(norm_w_ptr + second, mask=offs_i < HALF).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty)
    tl.store(p1, y1, mask=mask)
    tl.store(p2, y2, mask=mask)
    if TO_CACHE:
        c = cache_ptr + offs_h[:, None] * stride_cache_head
        tl.store(c + first[None, :], y1.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(c + second[None, :], y2.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr,
                 k_cache_ptr, v_cache_ptr, q_norm_ptr, k_norm_ptr, eps,
                 stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
                 stride_v_tok, stride_v_head, stride_table,
                 stride_kc_block, stride_kc_slot, stride_kc_head,
                 stride_vc_block, stride_vc_slot, stride_vc_head,
                 BLOCK_SIZE: tl.constexpr, NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
                 Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr,
                 HALF: tl.constexpr, HALF_PAD: tl.constexpr, NEOX: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                 WRITE_KV: tl.constexpr, QK_NORM: tl.constexpr, USE_PDL: tl.constexpr):
    """One program per token: rotate its q and k heads in place (QK-normed first with
    QK_NORM); with WRITE_KV also store the rotated k (and v) rows at slot_mapping[tok] unless
    that slot is a padding row (< 0)."""
    tok = tl.program_id(0)
    wait_for_previous_kernel(USE_PDL)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_i = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + pos * stride_table + offs_i, mask=offs_i < HALF)[None, :]
    sin = tl.load(sin_ptr + pos * stride_table + offs_i, mask=offs_i < HALF)[None, :]
    _rotate_heads(q_ptr + tok * stride_q_tok, stride_q_head, NUM_Q_HEADS, cos, sin,
                  Q_HEADS_PAD, HALF, HALF_PAD, NEOX, q_ptr, 0, False, q_norm_ptr, eps, QK_NORM)
    k_row = k_ptr + tok * stride_k_tok
    slot = -1
    if WRITE_KV:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        k_slot = k_cache_ptr + slot_offset(slot, BLOCK_SIZE, stride_kc_block, stride_kc_slot)
        v_slot = v_cache_ptr + slot_offset(slot, BLOCK_SIZE, stride_vc_block, stride_vc_slot)
        _rotate_heads(k_row, stride_k_head, NUM_K_HEADS, cos, sin, K_HEADS_PAD, HALF,
                      HALF_PAD, NEOX, k_slot, stride_kc_head, True, k_norm_ptr, eps, QK_NORM)
        offs_h = tl.arange(0, K_HEADS_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        mask_h = offs_h[:, None] < NUM_K_HEADS
        if 2 * HALF < HEAD_DIM:  # partial rotary: the untouched dims go to the cache as-is
            mask_p = mask_h & (offs_d[None, :] >= 2 * HALF) & (offs_d[None, :] < HEAD_DIM)
            kp = tl.load(k_row + offs_h[:, None] * stride_k_head + offs_d[None, :], mask=mask_p)
            tl.store(k_slot + offs_h[:, None] * stride_kc_head + offs_d[None, :],
                     kp.to(k_cache_ptr.dtype.element_ty), mask=mask_p)
        mask_v = mask_h & (offs_d[None, :] < HEAD_DIM)
        v = tl.load(v_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head
                    + offs_d[None, :], mask=mask_v)
        tl.store(v_slot + offs_h[:, None] * stride_vc_head + offs_d[None, :],
                 v.to(v_cache_ptr.dtype.element_ty), mask=mask_v)
    else:  # no cache write (or a padding row): rotate k in place only
        _rotate_heads(k_row, stride_k_head, NUM_K_HEADS, cos, sin, K_HEADS_PAD, HALF,
                      HALF_PAD, NEOX, k_ptr, 0, False, k_norm_ptr, eps, QK_NORM)


QKNorm = tuple[torch.Tensor, torch.Tensor, float]  # (q weight [D], k weight [D], eps)


def _launch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, is_neox_style: bool,
            kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
            qk_norm: QKNorm | None = None) -> None:
    """kv_write = (v, k_cache, v_cache, slot_mapping) or None (rotate only)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    half = cos.shape[1]
    if qk_norm is not None and not fuses_qk_norm(q, half, qk_norm):
        raise ValueError(f"the fused QK norm needs full rotary ({2 * half} rotated of "
                         f"{head_dim} dims) and [{head_dim}] weights in {q.dtype}")
    if num_tokens == 0:
        return
    v = kv_write[0] if kv_write is not None else k
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("RoPE kernels need a contiguous head_dim")
    if kv_write is not None:
        _, kc, vc, slots = kv_write  # caches [blocks, block_size, KVH, D]
        cache_strides = (*kc.stride()[:3], *vc.stride()[:3])
        block_size = kc.shape[1]
    else:  # unread: WRITE_KV is off
        kc, vc, slots, cache_strides, block_size = k, k, positions, (0,) * 6, 1
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)  # unread
    pdl = pdl_enabled(q.device)
    _rope_kernel[(num_tokens,)](
        q, k, v, positions, cos, sin, slots, kc, vc, q_weight, k_weight, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), *cache_strides, BLOCK_SIZE=block_size, NUM_Q_HEADS=q.shape[1],
        NUM_K_HEADS=num_kv_heads,
        Q_HEADS_PAD=triton.next_power_of_2(q.shape[1]),
        K_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), NEOX=is_neox_style,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        WRITE_KV=kv_write is not None, QK_NORM=qk_norm is not None, USE_PDL=pdl,
        launch_pdl=pdl, num_warps=4)


def rotary_embedding_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool) -> None:
    """q [T, H, D], k [T, KVH, D] rotated in place; cos/sin [max_pos, R/2] fp32, contiguous."""
    _launch(positions, q, k, cos, sin, is_neox_style, None)


def rope_and_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      is_neox_style: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, qk_norm: QKNorm | None = None) -> None:
    """rotary_embedding_ on q and k, then k and v into caches [blocks, block_size, KVH, D];
    qk_norm (module docstring) normalises q and k per head first, in the same launch."""
    _launch(positions, q, k, cos, sin, is_neox_style, (v, k_cache, v_cache, slot_mapping),
            qk_norm)


def fuses_qk_norm(q: torch.Tensor, rotary_half: int, qk_norm: QKNorm) -> bool:
    """Whether rope_and_write_kv can apply this QK norm to q [T, H, D] (and k): full rotary,
    one weight per dim, weights in q's dtype (RMSNorm's output dtype is then q's)."""
    q_weight, k_weight, _ = qk_norm
    head_dim = q.shape[-1]
    return (2 * rotary_half == head_dim and q_weight.shape == k_weight.shape == (head_dim,)
            and q_weight.dtype == k_weight.dtype == q.dtype)

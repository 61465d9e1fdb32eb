"""RoPE on q and k in place, one launch for both (one program per token, all its heads).

Same function as rotary.RotaryEmbedding (cos/sin tables [max_position, rotary_dim / 2] fp32,
already multiplied by the attention factor; the first rotary_dim dims of each head rotate, the
rest pass through untouched), computed in fp32 and rounded once to the activation dtype.
Pairs: neox style (x[i], x[i + R/2]); GPT-J style (x[2i], x[2i + 1]).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, stride_head, num_heads, cos, sin,
                  HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                  NEOX: tl.constexpr):
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
    x1 = tl.load(p1, mask=mask).to(tl.float32)
    x2 = tl.load(p2, mask=mask).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
                 stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_table,
                 NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
                 Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr,
                 HALF: tl.constexpr, HALF_PAD: tl.constexpr, NEOX: tl.constexpr):
    tok = tl.program_id(0)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_i = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + pos * stride_table + offs_i, mask=offs_i < HALF)[None, :]
    sin = tl.load(sin_ptr + pos * stride_table + offs_i, mask=offs_i < HALF)[None, :]
    _rotate_heads(q_ptr + tok * stride_q_tok, stride_q_head, NUM_Q_HEADS, cos, sin,
                  Q_HEADS_PAD, HALF, HALF_PAD, NEOX)
    _rotate_heads(k_ptr + tok * stride_k_tok, stride_k_head, NUM_K_HEADS, cos, sin,
                  K_HEADS_PAD, HALF, HALF_PAD, NEOX)


def rotary_embedding_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool) -> None:
    """q [T, H, D], k [T, KVH, D] rotated in place; cos/sin [max_pos, R/2] fp32, contiguous."""
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("rotary_embedding_ needs a contiguous head_dim")
    half = cos.shape[1]
    _rope_kernel[(num_tokens,)](
        q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1],
        Q_HEADS_PAD=triton.next_power_of_2(q.shape[1]),
        K_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), NEOX=is_neox_style, num_warps=4)

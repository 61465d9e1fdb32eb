"""Write this step's K and V rows into the paged cache, one launch for both.

slot_mapping[t] = block_id * block_size + offset is where token t goes; a negative slot marks a
padding row of a CUDA-graph batch, which writes nothing (so padded replays never touch a block
the block manager may have given to a real sequence). Slots are addressed as (block, offset)
through the cache's strides (slot_offset), so block-major caches (ops/kv_cache.py) work.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def slot_offset(slot, BLOCK_SIZE: tl.constexpr, stride_block, stride_slot):
    """Elements from a cache's start to slot `slot` (int64, >= 0)."""
    return (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                     stride_kc_block, stride_kc_slot, stride_kc_head,
                     stride_vc_block, stride_vc_slot, stride_vc_head,
                     BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                     HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_DIM_PAD: tl.constexpr):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, HEADS_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + tok * stride_k_tok + offs_h[:, None] * stride_k_head
                    + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head
                    + offs_d[None, :], mask=mask)
        k_row = k_cache_ptr + slot_offset(slot, BLOCK_SIZE, stride_kc_block, stride_kc_slot)
        v_row = v_cache_ptr + slot_offset(slot, BLOCK_SIZE, stride_vc_block, stride_vc_slot)
        tl.store(k_row + offs_h[:, None] * stride_kc_head + offs_d[None, :],
                 k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_row + offs_h[:, None] * stride_vc_head + offs_d[None, :],
                 v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, KVH, D] (head_dim contiguous) -> caches [blocks, block_size, KVH, D]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        BLOCK_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), num_warps=4)

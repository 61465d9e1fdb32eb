"""Paged attention: write this step's K/V into the block cache, then attend over it.

KV cache layout, per layer (what AITER's unified_attention reads as well)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

    sequence s with block_table [7, 2, 9], block_size 4, seq_len 10:
      positions 0-3 -> block 7, 4-7 -> block 2, 8-9 -> block 9 (slots 36, 37)

A batch is flat: the new tokens of every sequence concatenated ([T, ...]), delimited by
query_start_loc. Each sequence's queries are its last query_len positions and attend causally
to all seq_len positions (earlier chunks and prefix-cache hits included).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.workers.ops.backend import KernelBackend, require_torch_backend


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens sit in the paged cache. Built by the model runner."""

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset for each new token
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32: tokens in the cache after this step, per sequence
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies of query_start_loc / seq_lens so reference kernels never sync the device.
    query_start_loc_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


class Attention(nn.Module):
    """Stateless except for the KV cache tensors the model runner binds after allocating them."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 backend: KernelBackend = KernelBackend.TORCH) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        require_torch_backend(backend, "attention")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.backend = backend
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        expected = (self.num_kv_heads, self.head_dim)
        if tuple(k_cache.shape[2:]) != expected or k_cache.shape != v_cache.shape:
            raise ValueError(f"KV cache shape {tuple(k_cache.shape)} does not match "
                             f"(blocks, block_size, {expected[0]}, {expected[1]})")
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
        if self.k_cache is None:
            raise RuntimeError("Attention.forward before bind_kv_cache")
        write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return paged_attention_torch(q, self.k_cache, self.v_cache, meta, self.scale)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len positions of one sequence's K or V: [seq_len, KVH, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.reshape(num_blocks * block_size, *cache.shape[2:])[:seq_len]


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Reference paged attention: one SDPA call per sequence over its gathered context."""
    out = torch.empty_like(q)
    starts = meta.query_start_loc_host
    for i, seq_len in enumerate(meta.seq_lens_host):
        start, end = starts[i], starts[i + 1]
        query_len = end - start
        k = gather_kv(k_cache, meta.block_tables[i], seq_len)
        v = gather_kv(v_cache, meta.block_tables[i], seq_len)
        # Query j sits at absolute position seq_len - query_len + j and sees keys 0..that.
        if query_len == 1:
            mask = None
        else:
            key_pos = torch.arange(seq_len, device=q.device)
            query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]  # [query_len, seq_len]
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k.transpose(0, 1).to(q.dtype),
            v.transpose(0, 1).to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out

"""The contract between an op that keeps a paged KV cache and the model runner that allocates it.

Each such op says which tensors it needs (`kv_cache_shapes`) and which kind of cache they make
(`kv_cache_kind`, the name a KV handle's layout carries; common/kv_layout.py):

    kind           op                              tensors per layer, in bind order
    "mha"          Attention (attention.py)        K, V: [num_blocks, block_size, KVH, head_dim]
    "mla"          MLAAttention (mla.py)           latent: [num_blocks, block_size, 1, R + P]
    "mla_indexer"  SparseMLAAttention              latent as "mla", then the indexer's keys:
                   (sparse_mla.py)                 [num_blocks, block_size, 1, index_head_dim]

The runner allocates them, zeroed, in the model's dtype and on its device, and hands them back
through `bind_kv_cache` in the same order. Block b of every tensor of every layer belongs to the
same block-manager block b, and slot s (block * block_size + offset) of every tensor holds the
same token: an op writes all of its tensors' rows for a token in the same step.

A tensor's blocks are each contiguous, but its slots need not be: the runner lays caches out
block-major (a block of every layer together), so block b starts b * stride(0) elements in and
slot s lives at (s // block_size) * stride(0) + (s % block_size) * stride(1). Ops address
slots that way (write_slots here; gpu/kv_write.slot_offset in kernels), never through
cache.view(-1, ...).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

Shape = tuple[int, ...]
KV_CACHE_KINDS = ("mha", "mla", "mla_indexer")


def write_slots(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """cache [num_blocks, block_size, ...] row slot_mapping[t] <- rows[t] (cast to its dtype).
    Slots must be >= 0: the torch ops run eagerly, while the padded rows of a CUDA-graph batch
    (slot -1) only ever reach the GPU kernels, which skip them."""
    block_size = cache.shape[1]
    cache[slot_mapping // block_size, slot_mapping % block_size] = rows.to(cache.dtype)


@runtime_checkable
class KVCacheOwner(Protocol):
    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> tuple[Shape, ...]:
        """Shapes of the cache tensors this op needs; each starts with num_blocks."""

    def bind_kv_cache(self, *caches: torch.Tensor) -> None:
        """Receive tensors of exactly those shapes, in that order."""


def kv_cache_kind_of(owners: list[KVCacheOwner]) -> str | None:
    """The one kind every owner declares (`kv_cache_kind`), None if none declares one;
    ValueError if they disagree (a KV layout describes every layer alike)."""
    kinds = {getattr(owner, "kv_cache_kind", None) for owner in owners}
    if len(kinds) > 1:
        raise ValueError(f"attention layers keep different KV cache kinds: "
                         f"{sorted(map(str, kinds))}")
    return next(iter(kinds), None)

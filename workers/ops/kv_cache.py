"""The contract between an op that keeps a paged KV cache and the model runner that allocates it.

Each such op says which tensors it needs (`kv_cache_shapes`: MHA `Attention` asks for K and V of
[num_blocks, block_size, num_kv_heads, head_dim]; `MLAAttention` for one latent tensor of
[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]); the runner allocates them, zeroed,
in the model's dtype and on its device, and hands them back through `bind_kv_cache` in the same
order. Block b of every tensor of every layer belongs to the same block-manager block b.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

Shape = tuple[int, ...]


@runtime_checkable
class KVCacheOwner(Protocol):
    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> tuple[Shape, ...]:
        """Shapes of the cache tensors this op needs; each starts with num_blocks."""

    def bind_kv_cache(self, *caches: torch.Tensor) -> None:
        """Receive tensors of exactly those shapes, in that order."""

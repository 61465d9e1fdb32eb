"""A TP rank's share of selected KV blocks, and how rank 0 joins and splits the shares.

Each rank's cache holds its KV heads (TP rank r: heads [r * h, (r + 1) * h) with h per-rank
heads, or head r // replicas when heads are replicated). A rank's share of `block_ids` is one
tensor stacking every cache tensor of every layer:

    share [L * C, num_blocks, block_size, h, head_dim]   (C cache tensors per layer: K, V)

Rank 0 joins the shares of ranks 0..tp-1 along the head dim, so the KV handoff moves caches
that look like one rank's with tp * h heads, block i of the payload being block_ids[i]:

    joined [L][C]: [num_blocks, block_size, tp * h, head_dim]

A receiver with the same tp and h splits them back in rank order (replicated heads travel
once per rank, so the split needs no knowledge of the replication).
"""
from __future__ import annotations

import torch

KVCaches = list[tuple[torch.Tensor, ...]]
HEAD_DIM = 2  # of a cache tensor [blocks, block_size, heads, head_dim]


def local_share(kv_caches: KVCaches, block_ids: list[int]) -> torch.Tensor:
    """This rank's [L * C, n, block_size, h, head_dim] copy of the blocks."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
    return torch.stack([cache.index_select(0, index) for layer in kv_caches for cache in layer])


def write_local_share(kv_caches: KVCaches, block_ids: list[int], share: torch.Tensor) -> None:
    """Write a [L * C, n, ...] share (from `split_joined`) into this rank's blocks."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
    caches = [cache for layer in kv_caches for cache in layer]
    if share.shape[0] != len(caches):
        raise ValueError(f"KV share has {share.shape[0]} cache tensors, this rank has "
                         f"{len(caches)}")
    for cache, blocks in zip(caches, share):
        cache.index_copy_(0, index, blocks.to(device=cache.device, dtype=cache.dtype))


def join_shares(shares: list[torch.Tensor], num_tensors_per_layer: int) -> KVCaches:
    """Shares of ranks 0..tp-1 -> per layer, per cache tensor, all heads (see module doc)."""
    joined = torch.cat(shares, dim=HEAD_DIM + 1)  # [L * C, n, block_size, tp * h, head_dim]
    per_layer = joined.split(num_tensors_per_layer)
    return [tuple(layer.unbind(0)) for layer in per_layer]


def split_joined(joined: KVCaches, tp_size: int) -> list[torch.Tensor]:
    """The inverse of `join_shares`: one contiguous [L * C, n, ...] share per rank."""
    stacked = torch.stack([cache for layer in joined for cache in layer])
    num_heads = stacked.shape[HEAD_DIM + 1]
    if num_heads % tp_size:
        raise ValueError(f"KV payload has {num_heads} heads, not a multiple of the TP size "
                         f"{tp_size}")
    return [part.contiguous() for part in stacked.chunk(tp_size, dim=HEAD_DIM + 1)]

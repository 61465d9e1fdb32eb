"""A TP rank's share of selected KV blocks, and how rank 0 joins and splits the shares.

Each rank's cache holds its KV heads (TP rank r: heads [r * h, (r + 1) * h) with h per-rank
heads, or head r // replicas when heads are replicated; an MLA latent and DeepSeek-V3.2's
indexer keys are one head replicated on every rank). Every tensor of a layer is
[blocks, block_size, h, D_c] with the same h; the widths D_c may differ (MHA: K and V alike;
sparse MLA: the latent and the narrower indexer keys). A rank's share of `block_ids` is one
tensor stacking every layer, each layer's tensors side by side along the last dim:

    share [L, num_blocks, block_size, h, W]        W = sum of the layer's widths D_c

Rank 0 joins the shares of ranks 0..tp-1 along the head dim, so the KV handoff moves caches
that look like one rank's with tp * h heads, block i of the payload being block_ids[i]:

    joined [L][C]: [num_blocks, block_size, tp * h, D_c]

A receiver with the same tp and h splits them back in rank order (replicated heads travel
once per rank, so the split needs no knowledge of the replication).
"""
from __future__ import annotations

import torch

KVCaches = list[tuple[torch.Tensor, ...]]
HEAD_DIM = 2  # of a cache tensor [blocks, block_size, heads, head_dim]


def layer_widths(kv_caches: KVCaches) -> list[int]:
    """D_c of each tensor of a layer (every layer holds the same tensors)."""
    return [cache.shape[-1] for cache in kv_caches[0]]


def share_shape(kv_caches: KVCaches, num_blocks: int) -> tuple[int, ...]:
    """The shape of this rank's share of num_blocks blocks."""
    first = kv_caches[0][0]
    return (len(kv_caches), num_blocks, *first.shape[1:-1], sum(layer_widths(kv_caches)))


def local_share(kv_caches: KVCaches, block_ids: list[int]) -> torch.Tensor:
    """This rank's [L, n, block_size, h, W] copy of the blocks."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
    heads = {cache.shape[HEAD_DIM] for layer in kv_caches for cache in layer}
    if len(heads) != 1:
        raise ValueError(f"KV cache tensors hold different head counts {sorted(heads)}; a "
                         f"share needs one")
    return torch.stack([torch.cat([cache.index_select(0, index) for cache in layer], dim=-1)
                        for layer in kv_caches])


def write_local_share(kv_caches: KVCaches, block_ids: list[int], share: torch.Tensor) -> None:
    """Write an [L, n, ..., W] share (from `split_joined`) into this rank's blocks."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
    widths = layer_widths(kv_caches)
    if share.shape[0] != len(kv_caches) or share.shape[-1] != sum(widths):
        raise ValueError(f"KV share of shape {tuple(share.shape)} does not fit this rank's "
                         f"{len(kv_caches)} layers of widths {widths}")
    for layer, layer_share in zip(kv_caches, share):
        for cache, blocks in zip(layer, layer_share.split(widths, dim=-1)):
            cache.index_copy_(0, index, blocks.to(device=cache.device, dtype=cache.dtype))


def join_shares(shares: list[torch.Tensor], widths: list[int]) -> KVCaches:
    """Shares of ranks 0..tp-1 -> per layer, per cache tensor, all heads (see module doc).
    widths: the layer's tensor widths (`layer_widths`)."""
    joined = torch.cat(shares, dim=HEAD_DIM + 1)  # [L, n, block_size, tp * h, W]
    return [tuple(layer.split(widths, dim=-1)) for layer in joined.unbind(0)]


def split_joined(joined: KVCaches, tp_size: int) -> list[torch.Tensor]:
    """The inverse of `join_shares`: one contiguous [L, n, ..., W] share per rank."""
    stacked = torch.stack([torch.cat(layer, dim=-1) for layer in joined])
    num_heads = stacked.shape[HEAD_DIM + 1]
    if num_heads % tp_size:
        raise ValueError(f"KV payload has {num_heads} heads, not a multiple of the TP size "
                         f"{tp_size}")
    return [part.contiguous() for part in stacked.chunk(tp_size, dim=HEAD_DIM + 1)]

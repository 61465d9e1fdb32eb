"""Rank 0's join of every rank's KV heads, and its split back, against a one-rank cache."""
from __future__ import annotations

import torch

from tandem.workers.kv.kv_shards import (join_shares, layer_widths, local_share,
                                               share_shape, split_joined, write_local_share)

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, TP = 2, 6, 4, 4, 8, 2


def one_rank_cache(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, generator=gen)
                  for _ in range(2)) for _ in range(NUM_LAYERS)]


def rank_caches(full, rank: int):
    """What TP rank `rank` holds: its contiguous slice of the heads (QKVParallelLinear's)."""
    heads = NUM_HEADS // TP
    return [tuple(c[:, :, rank * heads:(rank + 1) * heads].clone() for c in layer)
            for layer in full]


def test_joined_blocks_equal_the_one_rank_cache_and_split_back_into_each_rank():
    full = one_rank_cache(0)
    block_ids = [4, 1, 3]
    shares = [local_share(rank_caches(full, r), block_ids) for r in range(TP)]
    joined = join_shares(shares, widths=[HEAD_DIM, HEAD_DIM])
    index = torch.tensor(block_ids)
    for layer, full_layer in zip(joined, full):
        for got, cache in zip(layer, full_layer):
            assert torch.equal(got, cache.index_select(0, index))

    receivers = [rank_caches(one_rank_cache(1), r) for r in range(TP)]
    for rank, share in enumerate(split_joined(joined, TP)):
        write_local_share(receivers[rank], [0, 5, 2], share)
    for rank in range(TP):
        sent = rank_caches(full, rank)
        for layer, sent_layer in zip(receivers[rank], sent):
            for got, cache in zip(layer, sent_layer):
                assert torch.equal(got[[0, 5, 2]], cache[block_ids])


def test_layers_of_tensors_of_different_widths_join_and_split_back():
    """Sparse MLA (DeepSeek-V3.2): a latent and narrower indexer keys, one head replicated on
    every rank; each rank gets back exactly its own tensors."""
    gen = torch.Generator().manual_seed(2)
    full = [(torch.randn(NUM_BLOCKS, BLOCK_SIZE, 1, 40, generator=gen),
             torch.randn(NUM_BLOCKS, BLOCK_SIZE, 1, 16, generator=gen))
            for _ in range(NUM_LAYERS)]
    block_ids = [5, 0]
    shares = [local_share(full, block_ids) for _ in range(TP)]
    assert shares[0].shape == share_shape(full, 2) == (NUM_LAYERS, 2, BLOCK_SIZE, 1, 56)
    joined = join_shares(shares, widths=layer_widths(full))
    assert [tuple(c.shape) for c in joined[0]] == [(2, BLOCK_SIZE, TP, 40),
                                                   (2, BLOCK_SIZE, TP, 16)]
    receivers = [[tuple(torch.zeros_like(c) for c in layer) for layer in full]
                 for _ in range(TP)]
    for rank, share in enumerate(split_joined(joined, TP)):
        write_local_share(receivers[rank], [1, 3], share)
    for receiver in receivers:
        for layer, full_layer in zip(receiver, full):
            for got, cache in zip(layer, full_layer):
                assert torch.equal(got[[1, 3]], cache[block_ids])

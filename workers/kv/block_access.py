"""Where the KV handoff reads the blocks it sends and writes the blocks it receives.

    blocks = kv_block_access(kv_caches, tp_size, gather, scatter)  # once, at start-up
    caches, ids = await blocks.read(block_ids)   # sender: iter_payload_chunks(caches, ids)
    writer = blocks.writer(block_ids)            # receiver: writer.write(...) per chunk,
    writer.check_complete(); await blocks.commit(block_ids, writer)

One rank (`DirectKVBlocks`): the event loop reads pinned blocks and writes reserved blocks in
this process's cache directly; the engine never touches them meanwhile (block_payload.py).

Several TP ranks (`RankGroupKVBlocks`): each rank holds its KV heads of every block
(kv_shards.py), and only the engine thread may issue collectives on the rank group
(executor/rank_runner.py). So the sender asks the engine thread to gather every rank's heads
of the blocks into one host copy, and the receiver stages the payload on the host and asks
the engine thread to scatter it (`gather` and `scatter`: KV rank ops every rank runs,
rank_group.RankGroupKV, passed in, so this module knows nothing of the engine). On the wire the blocks look like one rank's
with tp times the heads; the KV layout in the handle still carries the per-rank heads and
tp_size, so workers with different TP sizes refuse each other's handles
(KVLayout.check_readable_by).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import torch

from tandem.workers.kv.block_payload import KVCaches, PayloadWriter

# Every rank's KV heads of the blocks, joined (kv_shards.py), on the engine thread.
GatherBlocks = Callable[[list[int]], Awaitable[KVCaches]]
# Writes joined KV into the blocks on every rank, on the engine thread.
ScatterBlocks = Callable[[list[int], KVCaches], Awaitable[None]]


class KVBlockAccess(Protocol):
    async def read(self, block_ids: list[int]) -> tuple[KVCaches, list[int]]: ...

    def writer(self, block_ids: list[int]) -> PayloadWriter: ...

    async def commit(self, block_ids: list[int], writer: PayloadWriter) -> None: ...


class DirectKVBlocks:
    def __init__(self, kv_caches: KVCaches) -> None:
        self.kv_caches = kv_caches

    async def read(self, block_ids: list[int]) -> tuple[KVCaches, list[int]]:
        return self.kv_caches, block_ids

    def writer(self, block_ids: list[int]) -> PayloadWriter:
        return PayloadWriter(self.kv_caches, block_ids)

    async def commit(self, block_ids: list[int], writer: PayloadWriter) -> None:
        pass  # the writer wrote each layer into the cache as it completed


class RankGroupKVBlocks:
    def __init__(self, kv_caches: KVCaches, tp_size: int, gather: GatherBlocks,
                 scatter: ScatterBlocks) -> None:
        self.kv_caches = kv_caches  # rank 0's shard: the staging's shape, heads times tp_size
        self.tp_size = tp_size
        self._gather, self._scatter = gather, scatter

    async def read(self, block_ids: list[int]) -> tuple[KVCaches, list[int]]:
        joined = await self._gather(block_ids)
        return joined, list(range(len(block_ids)))

    def writer(self, block_ids: list[int]) -> PayloadWriter:
        """Writes into host staging shaped like the joined caches (block i = block_ids[i])."""
        staging = [tuple(torch.empty((len(block_ids), *cache.shape[1:-2],
                                      cache.shape[-2] * self.tp_size, cache.shape[-1]),
                                     dtype=cache.dtype) for cache in layer)
                   for layer in self.kv_caches]
        return PayloadWriter(staging, list(range(len(block_ids))))

    async def commit(self, block_ids: list[int], writer: PayloadWriter) -> None:
        await self._scatter(block_ids, writer.kv_caches)


def kv_block_access(kv_caches: KVCaches, tp_size: int, gather: GatherBlocks | None = None,
                    scatter: ScatterBlocks | None = None) -> KVBlockAccess:
    """kv_caches: this process's (rank 0's) cache; gather and scatter are needed when
    tp_size > 1."""
    if tp_size == 1:
        return DirectKVBlocks(kv_caches)
    if gather is None or scatter is None:
        raise ValueError("kv_block_access: a TP worker's blocks need gather and scatter")
    return RankGroupKVBlocks(kv_caches, tp_size, gather, scatter)

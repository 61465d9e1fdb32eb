"""Where the KV handoff reads the blocks it sends and writes the blocks it receives.

    blocks = kv_block_access(async_engine)       # picked once, at worker start-up
    caches, ids = await blocks.read(block_ids)   # sender: iter_payload_chunks(caches, ids)
    writer = blocks.writer(block_ids)            # receiver: writer.write(...) per chunk,
    writer.check_complete(); await blocks.commit(block_ids, writer)

One rank (`DirectKVBlocks`): the event loop reads pinned blocks and writes reserved blocks in
this process's cache directly; the engine never touches them meanwhile (block_payload.py).

Several TP ranks (`RankGroupKVBlocks`): each rank holds its KV heads of every block
(parallel/kv_shards.py), and only the engine thread may issue collectives on the rank group
(parallel/rank_runner.py). So the sender asks the engine thread to gather every rank's heads
of the blocks into one host copy, and the receiver stages the payload on the host and asks
the engine thread to scatter it. On the wire the blocks look like one rank's with tp times the
heads; the KV layout in the handle still carries the per-rank heads and tp_size, so workers
with different TP sizes refuse each other's handles (KVLayout.check_readable_by).
"""
from __future__ import annotations

from typing import Protocol

import torch

from tandem.workers.async_engine import AsyncEngine
from tandem.workers.kv.block_payload import KVCaches, PayloadWriter


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
    def __init__(self, engine: AsyncEngine, tp_size: int) -> None:
        self.engine = engine
        self.tp_size = tp_size

    async def read(self, block_ids: list[int]) -> tuple[KVCaches, list[int]]:
        joined = await self.engine.call(lambda e: e.runner.gather_kv_blocks(block_ids))
        return joined, list(range(len(block_ids)))

    def writer(self, block_ids: list[int]) -> PayloadWriter:
        """Writes into host staging shaped like the joined caches (block i = block_ids[i])."""
        staging = [tuple(torch.empty((len(block_ids), *cache.shape[1:-2],
                                      cache.shape[-2] * self.tp_size, cache.shape[-1]),
                                     dtype=cache.dtype) for cache in layer)
                   for layer in self.engine.engine.runner.kv_caches]
        return PayloadWriter(staging, list(range(len(block_ids))))

    async def commit(self, block_ids: list[int], writer: PayloadWriter) -> None:
        staged = writer.kv_caches
        await self.engine.call(lambda e: e.runner.scatter_kv_blocks(block_ids, staged))


def kv_block_access(engine: AsyncEngine) -> KVBlockAccess:
    tp_size = engine.engine.config.tensor_parallel_size
    if tp_size == 1:
        return DirectKVBlocks(engine.engine.runner.kv_caches)
    return RankGroupKVBlocks(engine, tp_size)

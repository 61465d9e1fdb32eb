"""Rank 0's event-loop end of a TP worker's KV shards: every call runs KV rank ops on every
rank (rank_ops.py), on the engine thread between steps, through what the worker passes in
(the AsyncEngine's `run_kv_ops` / `submit_kv_ops`), so this module knows nothing of the
engine.

    ranks = RankGroupKV(engine, tp_size)
    nixl = ranks.backend("nixl")                       # one backend's connectors
    exports = await nixl.setup(layout)                 # every rank's export, rank order
    slot, failed = await nixl.add_peer(export)         # failed: ranks that could not open it
    await nixl.load(slot, src_ids, dst_ids, timeout, what)   # KVTransferFailed if not done
    await nixl.remove_peer(slot)
    joined = await ranks.gather(block_ids)             # the grpc backend's view of the blocks
    await ranks.scatter(block_ids, joined)
"""
from __future__ import annotations

import itertools

from tandem.common.kv_layout import KVLayout
from tandem.workers.kv.block_payload import KVCaches
from tandem.workers.kv.rank_ops import (AddPeer, GatherBlocks, KVRankOp, Load, Poll,
                                        RemovePeer, ScatterBlocks, Setup)
from tandem.workers.kv.rank_transfers import drive_on_ranks


class RankGroupKV:
    def __init__(self, engine, tp_size: int) -> None:
        """engine: runs ops on every rank (`await engine.run_kv_ops(ops)` -> answers;
        `engine.submit_kv_ops(ops)` queues them without waiting)."""
        self._engine = engine
        self.tp_size = tp_size

    def backend(self, name: str) -> RankBackend:
        return RankBackend(self._engine, self.tp_size, name)

    async def gather(self, block_ids: list[int]) -> KVCaches:
        return await _one(self._engine, GatherBlocks(list(block_ids)))

    async def scatter(self, block_ids: list[int], joined: KVCaches) -> None:
        await _one(self._engine, ScatterBlocks(list(block_ids), joined))


class RankBackend:
    """One backend's connectors on every rank (rank_connector.RankConnector)."""

    def __init__(self, engine, tp_size: int, name: str) -> None:
        self._engine = engine
        self.tp_size = tp_size
        self.name = name
        self._slots = itertools.count()
        self._transfers = itertools.count()

    async def _one(self, op: KVRankOp):
        return await _one(self._engine, op)

    async def setup(self, layout: KVLayout) -> list[bytes]:
        """Every rank creates its connector over its cache; their exports (b"": that rank's
        was refused, see its log)."""
        return await self._one(Setup(self.name, layout))

    async def add_peer(self, export: bytes, slot: int | None = None) -> tuple[int, list[int]]:
        """(slot, ranks that could not open the source) for a source's export; given a slot,
        what was open there is replaced."""
        slot = next(self._slots) if slot is None else slot
        return slot, await self._one(AddPeer(self.name, slot, export))

    async def remove_peer(self, slot: int) -> None:
        await self._one(RemovePeer(self.name, slot))

    async def load(self, slot: int, src_ids: list[int], dst_ids: list[int],
                   timeout: float | None, what: str) -> None:
        """Every rank moves its heads of src_ids (the source under `slot`) into dst_ids; the
        engine steps meanwhile. KVTransferFailed when a rank failed or `timeout` passed (the
        transfer is then ended on every rank); a cancelled caller ends it too."""
        transfer = next(self._transfers)
        await drive_on_ranks(
            _OpRunner(self._engine),
            Load(self.name, transfer, slot, list(src_ids), list(dst_ids), timeout or 0.0),
            lambda finish: Poll(self.name, transfer, finish), timeout, what)


async def _one(engine, op: KVRankOp):
    return (await engine.run_kv_ops([op]))[0]


class _OpRunner:
    """drive_on_ranks' engine: one op at a time."""

    def __init__(self, engine) -> None:
        self._engine = engine

    async def call(self, op: KVRankOp):
        return (await self._engine.run_kv_ops([op]))[0]

    def submit(self, op: KVRankOp) -> None:
        self._engine.submit_kv_ops([op])

"""nixl KV transfer across a TP group: one NIXL agent per rank, every rank READs its own heads.

A TP worker's KV heads live in tp processes, so a nixl handoff is tp READs: the receiver's rank
r from the source's rank r (equal TP sizes and per-rank heads; the layout check refuses
anything else first). Block ids are the same on every rank of a worker (one block manager), so
every rank reads the same src -> dst pairs of its own heads. As in ipc_ranks.py, rank 0 drives
the ranks through the control channel from the engine thread:

    setup   NIXL_SETUP: every rank creates its agent over its cache; rank 0 gathers the
            exports and serves them as ExportNixlAgentResponse.ranks
    load    NIXL_LOAD: rank r loads the source's ranks[r] under a slot
    read    NIXL_READ: every rank READs its share, waiting at most the given time
    unload  NIXL_UNLOAD: every rank drops a slot (the source restarted)

After a load or a read every rank reports ok or failed (ipc_ranks.failed_ranks), so a failure
is an answer and the group stays in step. NIXL's one-thread rule holds per rank: a follower
makes every call on its command loop, rank 0 on the engine thread (RankGroupNixl goes through
engine.call; the export it serves is the one made at setup).

A READ blocks the engine thread (every rank's) until it completes: decode steps of the whole
group wait meanwhile, as for a TP cuda-ipc copy.
"""
from __future__ import annotations

import dataclasses
import itertools

from torch.distributed import ProcessGroup

from tandem.common.convert import layout_from_proto, layout_to_proto
from tandem.common.logging import get_logger
from tandem.v1 import worker_pb2
from tandem.workers.kv.block_payload import KVCaches
from tandem.workers.kv.layout import KVLayout
from tandem.workers.kv.nixl_backend import (NixlKVAgent, NixlPeer, NixlUnavailable,
                                            TensorBlocks)
from tandem.workers.kv.transport import KVTransferFailed
from tandem.workers.parallel.ipc_ranks import all_gather_bytes, failed_ranks
from tandem.workers.parallel.messages import Command, unpack_bytes

logger = get_logger(__name__)


class RankNixl:
    """One rank's end: its agent over its KV heads and the sources it loaded (slot -> peer)."""

    def __init__(self, kv_caches: KVCaches, rank: int) -> None:
        self.kv_caches = kv_caches
        self.rank = rank
        self.agent: NixlKVAgent | None = None
        self._export = b""
        self._peers: dict[int, NixlPeer] = {}

    def setup(self, layout: KVLayout) -> bytes:
        """Creates the agent (once per process: the cache stays registered for its life) and
        returns its export; b"" when NIXL refused (logged)."""
        if self.agent is None:
            try:
                self.agent = NixlKVAgent(self.kv_caches,
                                         dataclasses.replace(layout, tp_rank=self.rank))
            except (NixlUnavailable, ValueError) as exc:
                logger.error("rank %d: no NIXL agent: %s", self.rank, exc)
                return b""
            self._export = self.agent.export().SerializeToString()
        return self._export

    def load(self, slot: int, response: worker_pb2.ExportNixlAgentResponse) -> bool:
        """Loads the source's agent of this rank's number under `slot`; False, logged, when
        it cannot be."""
        self.unload(slot)
        try:
            if self.agent is None:
                raise NixlUnavailable("this rank has no NIXL agent")
            if len(response.ranks) <= self.rank:
                raise ValueError(f"the source exported {len(response.ranks)} rank agents")
            self._peers[slot] = self.agent.add_peer(response.ranks[self.rank])
        except (NixlUnavailable, ValueError) as exc:
            logger.warning("rank %d: loading NIXL source %d failed: %s", self.rank, slot, exc)
            return False
        return True

    def unload(self, slot: int) -> None:
        peer = self._peers.pop(slot, None)
        if peer is not None and self.agent is not None:
            self.agent.remove_peer(peer)

    def read(self, slot: int, src_ids: list[int], dst_ids: list[int], timeout: float) -> bool:
        """READs this rank's heads of the blocks and waits for them; False, logged, on
        failure (an unfinished READ has been cancelled)."""
        peer = self._peers.get(slot)
        if peer is None or self.agent is None:
            logger.warning("rank %d: NIXL READ from unloaded source %d", self.rank, slot)
            return False
        try:
            self.agent.read_blocks_blocking(peer, src_ids, dst_ids, timeout)
        except (KVTransferFailed, ValueError) as exc:
            logger.warning("rank %d: NIXL READ from source %d failed: %s", self.rank, slot, exc)
            return False
        return True

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()


def merge_rank_exports(exports: list[bytes]) -> worker_pb2.ExportNixlAgentResponse:
    """Every rank's export (rank order) -> the worker's: rank 0's fields plus `ranks`.
    NixlUnavailable naming the ranks whose agent was not created."""
    failed = [rank for rank, data in enumerate(exports) if not data]
    if failed:
        raise NixlUnavailable(f"no NIXL agent on rank(s) {failed} (see their logs)")
    ranks = [worker_pb2.ExportNixlAgentResponse.FromString(data) for data in exports]
    merged = worker_pb2.ExportNixlAgentResponse()
    merged.CopyFrom(ranks[0])
    merged.ranks.extend(ranks)
    return merged


class RankGroupNixl:
    """A TP worker's nixl end, on the event loop: what the servicers serve (export, endpoint)
    and what NixlReceiver calls (load_peer, unload_peer, read), each an engine command that
    every rank runs (LeaderRunner's *_kv_nixl methods)."""

    def __init__(self, engine, export: worker_pb2.ExportNixlAgentResponse,
                 tp_size: int) -> None:
        self._engine = engine
        self._export = export
        self.tp_size = tp_size
        self.endpoint = export.endpoint
        self._slots = itertools.count()

    @classmethod
    async def start(cls, engine, layout: KVLayout) -> RankGroupNixl:
        """Creates every rank's agent. Raises NixlUnavailable when one could not be."""
        export = await engine.call(lambda e: e.runner.setup_kv_nixl(layout_to_proto(layout)))
        logger.info("NIXL agents on all %d ranks (rank 0: %s)", len(export.ranks),
                    export.endpoint.agent_name)
        return cls(engine, export, len(export.ranks))

    def export(self) -> worker_pb2.ExportNixlAgentResponse:
        return self._export

    async def load_peer(self, response: worker_pb2.ExportNixlAgentResponse) -> NixlPeer:
        """Loads a source's rank agents on every rank. NixlUnavailable when any rank could
        not (or the source has another TP size)."""
        if len(response.ranks) != self.tp_size:
            raise NixlUnavailable(f"the source exported {len(response.ranks)} rank agents, "
                                  f"this worker has {self.tp_size} ranks")
        slot = next(self._slots)
        failed = await self._engine.call(lambda e: e.runner.load_kv_nixl_peer(slot, response))
        if failed:
            await self._engine.call(lambda e: e.runner.unload_kv_nixl_peer(slot))
            raise NixlUnavailable(f"loading the source's agents failed on rank(s) {failed} "
                                  f"(see their logs)")
        first = response.ranks[0]
        tensors = [TensorBlocks(t.base_address, t.block_stride_bytes, t.block_bytes,
                                t.num_blocks, t.device_id) for t in first.tensors]
        return NixlPeer(first.endpoint.agent_name, response.endpoint.export_id,
                        first.mem_type, tensors, slot=slot)

    async def unload_peer(self, peer: NixlPeer) -> None:
        await self._engine.call(lambda e: e.runner.unload_kv_nixl_peer(peer.slot))

    async def read(self, peer: NixlPeer, src_ids: list[int], dst_ids: list[int],
                   timeout: float) -> int:
        failed = await self._engine.call(
            lambda e: e.runner.read_kv_nixl(peer.slot, src_ids, dst_ids, timeout))
        if failed:
            raise KVTransferFailed(f"NIXL READ failed on rank(s) {failed} (see their logs)")
        return len(src_ids) * sum(t.block_bytes for t in peer.tensors) * self.tp_size

    def close(self) -> None:
        """Rank 0's agent deregisters its cache (followers' go with their processes)."""
        self._engine.engine.runner.close_kv_nixl()


def follow_nixl_command(nixl: RankNixl, command: Command, header, payload,
                        group: ProcessGroup | None) -> None:
    """A follower's side of NIXL_SETUP / NIXL_LOAD / NIXL_READ / NIXL_UNLOAD."""
    if command is Command.NIXL_SETUP:
        layout = layout_from_proto(worker_pb2.KVLayout.FromString(
            unpack_bytes(payload, int(header[1]))))
        all_gather_bytes(nixl.setup(layout), group)
    elif command is Command.NIXL_LOAD:
        slot, num_bytes = int(header[1]), int(header[2])
        response = worker_pb2.ExportNixlAgentResponse.FromString(unpack_bytes(payload,
                                                                              num_bytes))
        failed_ranks(nixl.load(slot, response), group)
    elif command is Command.NIXL_READ:
        slot, num_blocks, timeout_ms = int(header[1]), int(header[2]), int(header[3])
        ids = payload.tolist()
        failed_ranks(nixl.read(slot, ids[:num_blocks], ids[num_blocks:], timeout_ms / 1000),
                     group)
    elif command is Command.NIXL_UNLOAD:
        nixl.unload(int(header[1]))
    else:
        raise ValueError(f"not a nixl command: {command.name}")

"""nixl KV transfer across a TP group: one NIXL agent per rank, every rank READs its own heads.

A TP worker's KV heads live in tp processes, so a nixl handoff is tp READs: the receiver's rank
r from the source's rank r (equal TP sizes and per-rank heads; the layout check refuses
anything else first). Block ids are the same on every rank of a worker (one block manager), so
every rank reads the same src -> dst pairs of its own heads. As in ipc_ranks.py, rank 0 drives
the ranks through the control channel from the engine thread:

    setup   NIXL_SETUP: every rank creates its agent over its cache; rank 0 gathers the
            exports and serves them as NixlAgentExport.ranks
    load    NIXL_LOAD: rank r loads the source's ranks[r] under a slot
    read    NIXL_POST: every rank posts the READ of its share under a transfer id, then
            NIXL_POLL (rank 0's event loop sends one every <= 2 ms: rank_transfers.py) until
            the READ is done on every rank or failed on one; NIXL_POLL with cancel set
            aborts it everywhere
    unload  NIXL_UNLOAD: every rank drops a slot (the source restarted)

After a load every rank reports ok or failed (control_gathers.failed_ranks); after a post or a
poll every rank's status (PENDING, DONE, FAILED) is all-gathered, so every rank sees the same
TransferOutcome, a failure is an answer and the group stays in step. A READ that failed on one
rank is cancelled on the others at once, so a failed transfer writes nothing more anywhere.
NIXL's one-thread rule holds per rank: a follower makes every call on its command loop, rank 0
on the engine thread (RankGroupNixl goes through engine.call; the export it serves is the one
made at setup).

Engine steps run between the polls: a READ in flight holds no engine thread, so the group's
other requests keep decoding while a handoff lands (a poll costs one broadcast and one
all-gather on the control group).
"""
from __future__ import annotations

import dataclasses
import itertools

from torch.distributed import ProcessGroup

from tandem.common.kv_exports import (NixlAgentExport, layout_from_bytes,
                                      nixl_export_from_bytes, to_bytes)
from tandem.common.kv_layout import KVLayout
from tandem.common.logging import get_logger
from tandem.workers.kv.block_payload import KVCaches
from tandem.workers.kv.nixl_backend import NixlKVAgent, NixlPeer, NixlUnavailable, PostedRead
from tandem.workers.kv.transport import KVTransferFailed
from tandem.workers.parallel.control_gathers import all_gather_bytes, failed_ranks
from tandem.workers.parallel.messages import Command, unpack_bytes
from tandem.workers.parallel.rank_transfers import (DONE, FAILED, PENDING, TransferOutcome,
                                                    drive_on_ranks, gather_outcome)

logger = get_logger(__name__)


class RankNixl:
    """One rank's end: its agent over its KV heads and the sources it loaded (slot -> peer)."""

    def __init__(self, kv_caches: KVCaches, rank: int) -> None:
        self.kv_caches = kv_caches
        self.rank = rank
        self.agent: NixlKVAgent | None = None
        self._export = b""
        self._peers: dict[int, NixlPeer] = {}
        self._reads: dict[int, PostedRead] = {}  # transfer id -> this rank's READ, unsettled

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
            self._export = to_bytes(self.agent.export())
        return self._export

    def load(self, slot: int, export: NixlAgentExport) -> bool:
        """Loads the source's agent of this rank's number under `slot`; False, logged, when
        it cannot be."""
        self.unload(slot)
        try:
            if self.agent is None:
                raise NixlUnavailable("this rank has no NIXL agent")
            if len(export.ranks) <= self.rank:
                raise ValueError(f"the source exported {len(export.ranks)} rank agents")
            self._peers[slot] = self.agent.add_peer(export.ranks[self.rank])
        except (NixlUnavailable, ValueError) as exc:
            logger.warning("rank %d: loading NIXL source %d failed: %s", self.rank, slot, exc)
            return False
        return True

    def unload(self, slot: int) -> None:
        peer = self._peers.pop(slot, None)
        if peer is not None and self.agent is not None:
            self.agent.remove_peer(peer)

    def post(self, transfer: int, slot: int, src_ids: list[int], dst_ids: list[int],
             timeout: float, group: ProcessGroup | None) -> TransferOutcome:
        """Posts this rank's READ of its heads of the blocks as `transfer`; collective: every
        rank learns the group's outcome so far (settle)."""
        peer = self._peers.get(slot)
        if peer is None or self.agent is None:
            logger.warning("rank %d: NIXL READ from unloaded source %d", self.rank, slot)
            return self._settle(transfer, FAILED, group)
        try:
            self._reads[transfer] = self.agent.post_read(peer, src_ids, dst_ids, timeout)
        except (KVTransferFailed, ValueError) as exc:
            logger.warning("rank %d: NIXL READ from source %d failed: %s", self.rank, slot, exc)
            return self._settle(transfer, FAILED, group)
        return self.poll(transfer, False, group)  # it may already be over, or have failed

    def poll(self, transfer: int, cancel: bool, group: ProcessGroup | None) -> TransferOutcome:
        """Asks NIXL once about this rank's `transfer` (or cancels it); collective, as post.
        A transfer this rank no longer holds (already settled) counts as failed."""
        read = self._reads.get(transfer)
        if read is None:
            status = FAILED
        elif cancel:
            read.cancel()
            status = FAILED
        else:
            try:
                status = DONE if read.check() else PENDING
            except (KVTransferFailed, ValueError) as exc:
                logger.warning("rank %d: NIXL READ %d failed: %s", self.rank, transfer, exc)
                status = FAILED
        return self._settle(transfer, status, group)

    def _settle(self, transfer: int, status: int, group: ProcessGroup | None) -> TransferOutcome:
        """All-gathers every rank's status; once the READ is done everywhere or failed
        anywhere, every rank forgets it, cancelling its share if still in flight (so a
        failed transfer writes nothing more on any rank)."""
        outcome = gather_outcome(status, group)
        if outcome.settled:
            read = self._reads.pop(transfer, None)
            if read is not None and not outcome.done:
                read.cancel()
        return outcome

    @property
    def reads_in_flight(self) -> int:
        return len(self._reads)

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()


def merge_rank_exports(exports: list[bytes]) -> NixlAgentExport:
    """Every rank's export (rank order) -> the worker's: rank 0's fields plus `ranks`.
    NixlUnavailable naming the ranks whose agent was not created."""
    failed = [rank for rank, data in enumerate(exports) if not data]
    if failed:
        raise NixlUnavailable(f"no NIXL agent on rank(s) {failed} (see their logs)")
    ranks = tuple(nixl_export_from_bytes(data) for data in exports)
    return dataclasses.replace(ranks[0], ranks=ranks)


class RankGroupNixl:
    """A TP worker's nixl end, on the event loop: what the servicers serve (export, endpoint)
    and what NixlReceiver calls (load_peer, unload_peer, read), each an engine command that
    every rank runs (LeaderRunner's *_kv_nixl methods)."""

    def __init__(self, engine, export: NixlAgentExport, tp_size: int) -> None:
        self._engine = engine
        self._export = export
        self.tp_size = tp_size
        self.endpoint = export.endpoint
        self._slots = itertools.count()
        self._transfers = itertools.count()

    @classmethod
    async def start(cls, engine, layout: KVLayout) -> RankGroupNixl:
        """Creates every rank's agent. Raises NixlUnavailable when one could not be."""
        export = await engine.call(lambda e: e.runner.setup_kv_nixl(layout))
        logger.info("NIXL agents on all %d ranks (rank 0: %s)", len(export.ranks),
                    export.endpoint.agent_name)
        return cls(engine, export, len(export.ranks))

    def export(self) -> NixlAgentExport:
        return self._export

    async def load_peer(self, export: NixlAgentExport) -> NixlPeer:
        """Loads a source's rank agents on every rank. NixlUnavailable when any rank could
        not (or the source has another TP size)."""
        if len(export.ranks) != self.tp_size:
            raise NixlUnavailable(f"the source exported {len(export.ranks)} rank agents, "
                                  f"this worker has {self.tp_size} ranks")
        slot = next(self._slots)
        failed = await self._engine.call(lambda e: e.runner.load_kv_nixl_peer(slot, export))
        if failed:
            await self._engine.call(lambda e: e.runner.unload_kv_nixl_peer(slot))
            raise NixlUnavailable(f"loading the source's agents failed on rank(s) {failed} "
                                  f"(see their logs)")
        first = export.ranks[0]
        return NixlPeer(first.endpoint.agent_name, export.endpoint.export_id,
                        first.mem_type, list(first.tensors), slot=slot)

    async def unload_peer(self, peer: NixlPeer) -> None:
        await self._engine.call(lambda e: e.runner.unload_kv_nixl_peer(peer.slot))

    async def read(self, peer: NixlPeer, src_ids: list[int], dst_ids: list[int],
                   timeout: float) -> int:
        """Every rank READs its heads of the blocks; returns the bytes read. Engine steps go on
        while it is in flight. KVTransferFailed when a rank failed or `timeout` passed (the
        READ is then cancelled on every rank); a cancelled caller cancels it too."""
        transfer = next(self._transfers)
        await drive_on_ranks(
            self._engine,
            lambda e: e.runner.post_kv_nixl_read(transfer, peer.slot, src_ids, dst_ids, timeout),
            lambda finish: lambda e: e.runner.poll_kv_nixl_read(transfer, finish),
            timeout, f"NIXL READ of {len(src_ids)} blocks")
        return len(src_ids) * sum(t.block_bytes for t in peer.tensors) * self.tp_size

    def close(self) -> None:
        """Rank 0's agent deregisters its cache (followers' go with their processes)."""
        self._engine.engine.runner.close_kv_nixl()


def follow_nixl_command(nixl: RankNixl, command: Command, header, payload,
                        group: ProcessGroup | None) -> TransferOutcome | None:
    """A follower's side of NIXL_SETUP / NIXL_LOAD / NIXL_POST / NIXL_POLL / NIXL_UNLOAD;
    returns the outcome of a post or a poll (every rank sees the same), else None."""
    if command is Command.NIXL_SETUP:
        layout = layout_from_bytes(unpack_bytes(payload, int(header[1])))
        all_gather_bytes(nixl.setup(layout), group)
    elif command is Command.NIXL_LOAD:
        slot, num_bytes = int(header[1]), int(header[2])
        export = nixl_export_from_bytes(unpack_bytes(payload, num_bytes))
        failed_ranks(nixl.load(slot, export), group)
    elif command is Command.NIXL_POST:
        transfer, slot, num_blocks, timeout_ms = (int(v) for v in header[1:5])
        ids = payload.tolist()
        return nixl.post(transfer, slot, ids[:num_blocks], ids[num_blocks:],
                         timeout_ms / 1000, group)
    elif command is Command.NIXL_POLL:
        return nixl.poll(int(header[1]), bool(header[2]), group)
    elif command is Command.NIXL_UNLOAD:
        nixl.unload(int(header[1]))
    else:
        raise ValueError(f"not a nixl command: {command.name}")
    return None

"""nixl KV transfer across a TP group: one NIXL agent per rank, every rank READs its own heads
(rank_connector.RankConnector).

A TP worker's KV heads live in tp processes, so a nixl handoff is tp READs: the receiver's rank
r from the source's rank r (equal TP sizes and per-rank heads; the layout check refuses
anything else first). Block ids are the same on every rank of a worker (one block manager), so
every rank reads the same src -> dst pairs of its own heads. As with cuda-ipc, rank 0 drives
the ranks with KV rank ops in its step broadcast (rank_ops.py), from the engine thread:

    setup   every rank creates its agent over its cache; rank 0 gathers the exports and
            serves them as NixlAgentExport.ranks (merge_rank_exports)
    peer    rank r loads the source's ranks[r] under a slot; removing the slot unloads it
    load    every rank posts the READ of its share under a transfer id, then polls (rank 0's
            event loop sends one every <= 2 ms: rank_transfers.py) until the READ is done on
            every rank or failed on one; a finishing poll aborts it everywhere

A READ that failed on one rank is cancelled on the others when the group settles it, so a
failed transfer writes nothing more anywhere. NIXL's one-thread rule holds per rank: every call
is made by the thread that runs the rank's ops (rank 0: the engine thread; a follower: its
command loop), and each READ runs on its agent's thread.

Engine steps run between the polls: a READ in flight holds no engine thread, so the group's
other requests keep decoding while a handoff lands.
"""
from __future__ import annotations

import dataclasses

import torch

from tandem.common.kv_exports import NixlAgentExport, nixl_export_from_bytes, to_bytes
from tandem.common.kv_layout import KVLayout
from tandem.common.logging import get_logger
from tandem.workers.kv.block_payload import KVCaches
from tandem.workers.kv.nixl_backend import NixlKVAgent, NixlPeer, NixlUnavailable, PostedRead
from tandem.workers.kv.rank_connector import rank_export
from tandem.workers.kv.rank_transfers import DONE, FAILED, PENDING
from tandem.workers.kv.transport import KVTransferFailed

logger = get_logger(__name__)


class RankNixl:
    """One rank's end: its agent over its KV heads and the sources it loaded (slot -> peer)."""

    def __init__(self, kv_caches: KVCaches, device: torch.device | None = None,
                 rank: int = 0) -> None:
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

    def add_peer(self, slot: int, export: bytes) -> bool:
        """Loads the source's agent of this rank's number (every rank's NixlAgentExport,
        to_bytes, packed by pack_rank_exports) under `slot`; False, logged, when it cannot
        be."""
        self.remove_peer(slot)
        try:
            if self.agent is None:
                raise NixlUnavailable("this rank has no NIXL agent")
            source = nixl_export_from_bytes(rank_export(export, self.rank))
            self._peers[slot] = self.agent.add_peer(source)
        except (NixlUnavailable, ValueError) as exc:
            logger.warning("rank %d: loading NIXL source %d failed: %s", self.rank, slot, exc)
            return False
        return True

    def remove_peer(self, slot: int) -> None:
        peer = self._peers.pop(slot, None)
        if peer is not None and self.agent is not None:
            self.agent.remove_peer(peer)

    def start_load(self, transfer: int, slot: int, src_ids: list[int], dst_ids: list[int],
                   timeout: float) -> int:
        """Posts this rank's READ of its heads of the blocks as `transfer`; its status."""
        peer = self._peers.get(slot)
        if peer is None or self.agent is None:
            logger.warning("rank %d: NIXL READ from unloaded source %d", self.rank, slot)
            return FAILED
        try:
            self._reads[transfer] = self.agent.post_read(peer, src_ids, dst_ids, timeout)
        except (KVTransferFailed, ValueError) as exc:
            logger.warning("rank %d: NIXL READ from source %d failed: %s", self.rank, slot, exc)
            return FAILED
        return self.poll(transfer, False)  # it may already be over, or have failed

    def poll(self, transfer: int, finish: bool) -> int:
        """Asks NIXL once about this rank's `transfer` (with finish: cancels it). A transfer
        this rank no longer holds (already settled) counts as failed."""
        read = self._reads.get(transfer)
        if read is None:
            return FAILED
        if finish:
            read.cancel()
            return FAILED
        try:
            return DONE if read.check() else PENDING
        except (KVTransferFailed, ValueError) as exc:
            logger.warning("rank %d: NIXL READ %d failed: %s", self.rank, transfer, exc)
            return FAILED

    def settle(self, transfer: int, done: bool) -> None:
        """The group settled the READ: forget it, cancelling this rank's share if it is still
        in flight (so a failed transfer writes nothing more on any rank)."""
        read = self._reads.pop(transfer, None)
        if read is not None and not done:
            read.cancel()

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


RANK_CONNECTOR = RankNixl

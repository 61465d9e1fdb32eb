"""cuda-ipc KV transfer across a TP group: every rank maps and copies its own share
(rank_connector.RankConnector).

A TP worker's KV heads live on tp GPUs, so one handoff by cuda-ipc is tp copies: the source's
rank r to the receiver's rank r (equal TP sizes and per-rank heads; the layout check refuses
anything else before this runs). The block ids are the same on every rank of a worker (one
block manager), so each rank copies the same src -> dst pairs of its own heads.

Rank 0 drives the ranks with KV rank ops in its step broadcast (rank_ops.py), from the engine
thread like every collective of the group:

    setup  every rank compiles its block gather and exports its cache; rank 0 receives the
           followers' exports (the prefill side serves them in ExportKVCache)
    peer   rank 0 sends a source's export; rank r maps the source's rank r under a slot
    load   every rank queues its share on its copy stream under a transfer id and waits for
           it at most POST_WAIT_SECONDS; then, unless done everywhere, polls (rank 0's event
           loop sends one every <= 2 ms, rank_transfers.py) until the copy is done on every
           rank or failed on one; a finishing poll waits the copy out on every rank

The engine steps between polls: a copy in flight holds no engine thread past its post's short
wait. A copy cannot be stopped once queued, so a rank whose copy is still running when the
transfer settles as failed (another rank failed) waits for it there: once settled, nothing of
the transfer writes on any rank.
"""
from __future__ import annotations

import time

import torch

from tandem.common.kv_exports import cuda_ipc_export_from_bytes, to_bytes
from tandem.common.kv_layout import KVLayout
from tandem.common.logging import get_logger
from tandem.workers.kv import cuda_ipc
from tandem.workers.kv.block_payload import KVCaches
from tandem.workers.kv.rank_transfers import DONE, FAILED, PENDING

logger = get_logger(__name__)

# How long a post waits for its copy before answering (the engine thread and the ranks' command
# loops are held meanwhile). A copy done by then activates its request at the next step rather
# than one poll later (a poll runs between engine steps): on 2 H200s a TP=2 handoff's gap was
# 27 ms posting without a wait against 22 ms copying synchronously, with 6 ms steps. 2 ms
# covers ~700 MiB per rank at NVLink speed (a 4000-token 8B prompt is 250 MiB per rank at TP=2).
POST_WAIT_SECONDS = 2e-3


class RankIpcPeers:
    """One rank's end: its cache's export, the sources it has mapped (slot -> copier from the
    source's cache of this rank's number into this rank's cache) and its copies in flight."""

    def __init__(self, kv_caches: KVCaches, device: torch.device, rank: int) -> None:
        self.local = cuda_ipc.flat_caches(kv_caches)
        self.kv_caches = kv_caches
        self.device = device
        self.rank = rank
        self._export: bytes | None = None
        self._copiers: dict[int, cuda_ipc.BlockCopier] = {}  # slot -> its copier
        self._copies: dict[int, torch.cuda.Event] = {}  # transfer id -> its copy's event
        self._stream: torch.cuda.Stream | None = None  # the copy stream, made on first use

    def setup(self, layout: KVLayout | None = None) -> bytes:
        """Compiles the gather (so no handoff compiles it) and exports this rank's cache, once
        per process (sharing a storage again would wrap its pointer again)."""
        if self._export is None:
            cuda_ipc.BlockCopier(self.local, self.local).precompile()
            self._export = to_bytes(cuda_ipc.export_rank_cache(self.kv_caches))
        return self._export

    def add_peer(self, slot: int, export: bytes) -> bool:
        """Maps the source's cache of this rank's number (a CudaIpcExport, to_bytes) under
        `slot`, replacing what was there; False, logged, when CUDA refuses."""
        self._copiers.pop(slot, None)  # a stale mapping is never used again
        try:
            peer = cuda_ipc.open_peer(cuda_ipc_export_from_bytes(export), self.device,
                                      self.rank)
            self._copiers[slot] = cuda_ipc.BlockCopier(peer.caches, self.local)
        except (cuda_ipc.CudaIpcUnavailable, ValueError) as exc:
            logger.warning("rank %d: cuda-ipc map of slot %d failed: %s", self.rank, slot, exc)
            return False
        return True

    def remove_peer(self, slot: int) -> None:
        self._copiers.pop(slot, None)

    def start_load(self, transfer: int, slot: int, src_ids: list[int], dst_ids: list[int],
                   timeout: float | None = None) -> int:
        """Queues this rank's share of the copy on the copy stream as `transfer` (after the
        work already queued on the compute stream: the blocks' last writers); its status
        after a short wait. (A queued copy is not stopped by a timeout.)"""
        copier = self._copiers.get(slot)
        if copier is None:
            logger.warning("rank %d: cuda-ipc copy from unmapped slot %d", self.rank, slot)
            return FAILED
        try:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            done = self._copies[transfer] = copier.launch(src_ids, dst_ids, self._stream)
            wait_briefly(done, POST_WAIT_SECONDS)
        except (RuntimeError, ValueError) as exc:  # launch raised (nothing of it runs), or CUDA
            logger.warning("rank %d: cuda-ipc copy from slot %d failed: %s", self.rank, slot,
                           exc)
            return FAILED
        return self.poll(transfer, False)

    def poll(self, transfer: int, finish: bool) -> int:
        """This rank's copy of `transfer` (with finish, waited for first). A transfer this
        rank no longer holds counts as failed."""
        done = self._copies.get(transfer)
        if done is None:
            return FAILED
        try:
            if finish:
                done.synchronize()
            status = DONE if done.query() else PENDING
        except RuntimeError as exc:  # a CUDA error surfaced by the copy
            logger.warning("rank %d: cuda-ipc copy %d failed: %s", self.rank, transfer, exc)
            status = FAILED
        if finish and status != DONE:
            status = FAILED
        return status

    def settle(self, transfer: int, done: bool) -> None:
        """The group settled the copy: forget it, first waiting out this rank's share if
        the transfer failed elsewhere while it still runs here."""
        event = self._copies.pop(transfer, None)
        if event is not None and not done:
            try:
                event.synchronize()
            except RuntimeError:  # reported already (or by the next poll's query)
                pass

    @property
    def copies_in_flight(self) -> int:
        return len(self._copies)

    def close(self) -> None:
        pass  # the mappings and streams go with the process


def wait_briefly(event: torch.cuda.Event, seconds: float) -> None:
    """Returns once `event` completed or `seconds` passed, whichever comes first."""
    deadline = time.monotonic() + seconds
    while not event.query() and time.monotonic() < deadline:
        time.sleep(2e-5)


RANK_CONNECTOR = RankIpcPeers

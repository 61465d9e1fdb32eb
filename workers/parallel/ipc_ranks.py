"""cuda-ipc KV transfer across a TP group: every rank maps and copies its own share.

A TP worker's KV heads live on tp GPUs, so one handoff by cuda-ipc is tp copies: the source's
rank r to the receiver's rank r (equal TP sizes and per-rank heads; the layout check refuses
anything else before this runs). The block ids are the same on every rank of a worker (one
block manager), so each rank copies the same src -> dst pairs of its own heads.

Rank 0 drives the ranks through the control channel (messages.py), from the engine thread like
every collective of the group:

    setup  IPC_SETUP: every rank compiles its block gather and exports its cache; rank 0
           receives the followers' exports (the prefill side serves them in ExportKVCache)
    map    IPC_MAP: rank 0 sends a source's export; rank r maps the source's rank r under a slot
    copy   IPC_POST: rank 0 sends the block ids; every rank queues its share on its copy
           stream under a transfer id and waits for it at most POST_WAIT_SECONDS; then, unless
           done everywhere, IPC_POLL (rank 0's event loop sends one every <= 2 ms,
           rank_transfers.py) until the copy is done on every rank or failed on one;
           IPC_POLL with finish set waits the copy out on every rank

After a map every rank reports ok or failed (control_gathers.failed_ranks); after a post or a
poll every rank's status is all-gathered (rank_transfers.TransferOutcome). Either way a failure
stays an answer rather than a group whose ranks disagree on what comes next. The engine steps
between polls: a copy in flight holds no engine thread past its post's short wait. A copy
cannot be stopped once queued, so a rank whose copy is still running when the transfer settles
as failed (another rank failed) waits for it there: once settled, nothing of the transfer
writes on any rank.
"""
from __future__ import annotations

import time

import torch
from torch.distributed import ProcessGroup

from tandem.common.kv_exports import CudaIpcExport, cuda_ipc_export_from_bytes, to_bytes
from tandem.common.logging import get_logger
from tandem.workers.kv import cuda_ipc
from tandem.workers.kv.block_payload import KVCaches
from tandem.workers.parallel.control_gathers import all_gather_bytes, failed_ranks
from tandem.workers.parallel.messages import Command, unpack_bytes
from tandem.workers.parallel.rank_transfers import (DONE, FAILED, PENDING, TransferOutcome,
                                                    gather_outcome)

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

    def setup(self) -> bytes:
        """Compiles the gather (so no handoff compiles it) and exports this rank's cache, once
        per process (sharing a storage again would wrap its pointer again)."""
        if self._export is None:
            cuda_ipc.BlockCopier(self.local, self.local).precompile()
            self._export = to_bytes(cuda_ipc.export_rank_cache(self.kv_caches))
        return self._export

    def map(self, slot: int, export: CudaIpcExport) -> bool:
        """Maps the source's cache of this rank's number under `slot` (replacing what was
        there); False, logged, when CUDA refuses."""
        self._copiers.pop(slot, None)  # a stale mapping is never used again
        try:
            peer = cuda_ipc.open_peer(export, self.device, self.rank)
            self._copiers[slot] = cuda_ipc.BlockCopier(peer.caches, self.local)
        except (cuda_ipc.CudaIpcUnavailable, ValueError) as exc:
            logger.warning("rank %d: cuda-ipc map of slot %d failed: %s", self.rank, slot, exc)
            return False
        return True

    def post(self, transfer: int, slot: int, src_ids: list[int], dst_ids: list[int],
             group: ProcessGroup | None) -> TransferOutcome:
        """Queues this rank's share of the copy on the copy stream as `transfer` (after the
        work already queued on the compute stream: the blocks' last writers); collective:
        every rank learns the group's outcome so far."""
        copier = self._copiers.get(slot)
        if copier is None:
            logger.warning("rank %d: cuda-ipc copy from unmapped slot %d", self.rank, slot)
            return self._settle(transfer, FAILED, group)
        try:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            done = self._copies[transfer] = copier.launch(src_ids, dst_ids, self._stream)
            wait_briefly(done, POST_WAIT_SECONDS)
        except (RuntimeError, ValueError) as exc:  # launch raised (nothing of it runs), or CUDA
            logger.warning("rank %d: cuda-ipc copy from slot %d failed: %s", self.rank, slot,
                           exc)
            return self._settle(transfer, FAILED, group)
        return self.poll(transfer, False, group)

    def poll(self, transfer: int, finish: bool, group: ProcessGroup | None) -> TransferOutcome:
        """Checks this rank's copy of `transfer` (with finish, waits for it first);
        collective, as post. A transfer this rank no longer holds counts as failed."""
        done = self._copies.get(transfer)
        if done is None:
            status = FAILED
        else:
            try:
                if finish:
                    done.synchronize()
                status = DONE if done.query() else PENDING
            except RuntimeError as exc:  # a CUDA error surfaced by the copy
                logger.warning("rank %d: cuda-ipc copy %d failed: %s", self.rank, transfer,
                               exc)
                status = FAILED
            if finish and status != DONE:
                status = FAILED
        return self._settle(transfer, status, group)

    def _settle(self, transfer: int, status: int, group: ProcessGroup | None
                ) -> TransferOutcome:
        """All-gathers every rank's status; once the copy is done everywhere or failed
        anywhere, every rank forgets it, first waiting out its share if still running."""
        outcome = gather_outcome(status, group)
        if outcome.settled:
            done = self._copies.pop(transfer, None)
            if done is not None and not outcome.done:
                try:
                    done.synchronize()
                except RuntimeError:  # reported already (or by the next poll's query)
                    pass
        return outcome

    @property
    def copies_in_flight(self) -> int:
        return len(self._copies)


def wait_briefly(event: torch.cuda.Event, seconds: float) -> None:
    """Returns once `event` completed or `seconds` passed, whichever comes first."""
    deadline = time.monotonic() + seconds
    while not event.query() and time.monotonic() < deadline:
        time.sleep(2e-5)


def follow_ipc_command(ipc: RankIpcPeers, command: Command, header: torch.Tensor,
                       payload: torch.Tensor, group: ProcessGroup | None) -> None:
    """A follower's side of IPC_SETUP / IPC_MAP / IPC_POST / IPC_POLL."""
    if command is Command.IPC_SETUP:
        all_gather_bytes(ipc.setup(), group)
    elif command is Command.IPC_MAP:
        slot, num_bytes = int(header[1]), int(header[2])
        export = cuda_ipc_export_from_bytes(unpack_bytes(payload, num_bytes))
        failed_ranks(ipc.map(slot, export), group)
    elif command is Command.IPC_POST:
        transfer, slot, num_blocks = (int(v) for v in header[1:4])
        ids = payload.tolist()
        ipc.post(transfer, slot, ids[:num_blocks], ids[num_blocks:], group)
    elif command is Command.IPC_POLL:
        ipc.poll(int(header[1]), bool(header[2]), group)
    else:
        raise ValueError(f"not a cuda-ipc command: {command.name}")

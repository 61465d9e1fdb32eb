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
    copy   IPC_COPY: rank 0 sends the block ids; every rank copies its share and waits for it

After map and copy every rank reports ok or failed (one int each, all-gathered on the control
group): rank 0 learns which ranks failed, and a failure stays an answer rather than a group
whose ranks disagree on what comes next.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tandem.common.logging import get_logger
from tandem.v1 import worker_pb2
from tandem.workers.kv import cuda_ipc
from tandem.workers.kv.block_payload import KVCaches
from tandem.workers.parallel.messages import Command, pack_bytes, packed_length, unpack_bytes

logger = get_logger(__name__)


class RankIpcPeers:
    """One rank's end: its cache's export and the sources it has mapped (slot -> copier from
    the source's cache of this rank's number into this rank's cache)."""

    def __init__(self, kv_caches: KVCaches, device: torch.device, rank: int) -> None:
        self.local = cuda_ipc.flat_caches(kv_caches)
        self.kv_caches = kv_caches
        self.device = device
        self.rank = rank
        self._export: bytes | None = None
        self._copiers: dict[int, cuda_ipc.BlockCopier] = {}  # slot -> its copier

    def setup(self) -> bytes:
        """Compiles the gather (so no handoff compiles it) and exports this rank's cache, once
        per process (sharing a storage again would wrap its pointer again)."""
        if self._export is None:
            cuda_ipc.BlockCopier(self.local, self.local).precompile()
            self._export = cuda_ipc.export_rank_cache(self.kv_caches).SerializeToString()
        return self._export

    def map(self, slot: int, response: worker_pb2.ExportKVCacheResponse) -> bool:
        """Maps the source's cache of this rank's number under `slot` (replacing what was
        there); False, logged, when CUDA refuses."""
        self._copiers.pop(slot, None)  # a stale mapping is never used again
        try:
            peer = cuda_ipc.open_peer(response, self.device, self.rank)
            self._copiers[slot] = cuda_ipc.BlockCopier(peer.caches, self.local)
        except (cuda_ipc.CudaIpcUnavailable, ValueError) as exc:
            logger.warning("rank %d: cuda-ipc map of slot %d failed: %s", self.rank, slot, exc)
            return False
        return True

    def copy(self, slot: int, src_ids: list[int], dst_ids: list[int]) -> bool:
        """Copies this rank's share of the blocks and waits for it; False, logged, on failure."""
        copier = self._copiers.get(slot)
        if copier is None:
            logger.warning("rank %d: cuda-ipc copy from unmapped slot %d", self.rank, slot)
            return False
        try:
            copier.copy(src_ids, dst_ids)
        except (RuntimeError, ValueError) as exc:
            logger.warning("rank %d: cuda-ipc copy from slot %d failed: %s", self.rank, slot,
                           exc)
            return False
        return True


def all_gather_bytes(data: bytes, group: ProcessGroup | None) -> list[bytes]:
    """Every rank's `data`, in rank order, on every rank (lengths first, then padded values)."""
    world = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64), group=group)
    sizes = [int(n) for n in lengths]
    width = packed_length(max(sizes))
    mine = torch.zeros(width, dtype=torch.int64)
    mine[:packed_length(len(data))] = pack_bytes(data)
    values = [torch.empty(width, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(values, mine, group=group)
    return [unpack_bytes(v, n) for v, n in zip(values, sizes)]


def all_gather_ints(value: int, group: ProcessGroup | None) -> list[int]:
    """Every rank's `value`, in rank order, on every rank."""
    world = dist.get_world_size(group)
    values = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(values, torch.tensor([value], dtype=torch.int64), group=group)
    return [int(v) for v in values]


def failed_ranks(ok: bool, group: ProcessGroup | None) -> list[int]:
    """Every rank says whether its part worked; all learn which ranks failed."""
    return [rank for rank, flag in enumerate(all_gather_ints(0 if ok else 1, group)) if flag]


def follow_ipc_command(ipc: RankIpcPeers, command: Command, header: torch.Tensor,
                       payload: torch.Tensor, group: ProcessGroup | None) -> None:
    """A follower's side of IPC_SETUP / IPC_MAP / IPC_COPY."""
    if command is Command.IPC_SETUP:
        all_gather_bytes(ipc.setup(), group)
    elif command is Command.IPC_MAP:
        slot, num_bytes = int(header[1]), int(header[2])
        response = worker_pb2.ExportKVCacheResponse.FromString(unpack_bytes(payload,
                                                                            num_bytes))
        failed_ranks(ipc.map(slot, response), group)
    elif command is Command.IPC_COPY:
        slot, num_blocks = int(header[1]), int(header[2])
        ids = payload.tolist()
        failed_ranks(ipc.copy(slot, ids[:num_blocks], ids[num_blocks:]), group)
    else:
        raise ValueError(f"not a cuda-ipc command: {command.name}")

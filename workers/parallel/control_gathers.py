"""Small all-gathers on a TP group's control group (gloo, host tensors): how rank 0 and its
followers agree on each rank's answer to a command (an export, ok or failed, a status)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tandem.workers.parallel.messages import pack_bytes, packed_length, unpack_bytes


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

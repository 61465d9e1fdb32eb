"""The worker-side half of a KV connector: one per rank, moving that rank's shard of the cache.

A backend whose transfers run on every TP rank (cuda-ipc, nixl, mori) implements this once;
rank 0 drives every rank's instance through KV rank ops (rank_ops.py) carried in the step
broadcast, and the group's answers are gathered there, so an implementation never issues a
collective itself:

    connector = cls(kv_caches, device, rank)     # on the first Setup op
    export = connector.setup(layout)             # registers the cache; b"": refused (logged)
    ok = connector.add_peer(slot, export)        # a source's export (every rank's inside);
                                                 # this rank opens the share of its number
    connector.remove_peer(slot)
    status = connector.start_load(transfer, slot, src_ids, dst_ids, timeout)
    status = connector.poll(transfer, finish)    # finish: end it (wait out or cancel) first
    connector.settle(transfer, done)             # the group settled it: forget it, ending
                                                 # this rank's share if still running
    connector.close()                            # at shutdown

Statuses are rank_transfers.PENDING, DONE or FAILED. A transfer this rank does not hold counts
as FAILED. Block ids are the same on every rank (one block manager per worker), so every rank
moves the same src -> dst pairs of its own heads.
"""
from __future__ import annotations

import base64
import json
from typing import Protocol

import torch

from tandem.common.kv_layout import KVLayout
from tandem.workers.kv.block_payload import KVCaches


class RankConnector(Protocol):
    def __init__(self, kv_caches: KVCaches, device: torch.device, rank: int) -> None: ...

    def setup(self, layout: KVLayout) -> bytes: ...

    def add_peer(self, slot: int, export: bytes) -> bool: ...

    def remove_peer(self, slot: int) -> None: ...

    def start_load(self, transfer: int, slot: int, src_ids: list[int], dst_ids: list[int],
                   timeout: float) -> int: ...

    def poll(self, transfer: int, finish: bool) -> int: ...

    def settle(self, transfer: int, done: bool) -> None: ...

    def close(self) -> None: ...


def pack_rank_exports(ranks: tuple[bytes, ...] | list[bytes]) -> bytes:
    """Every rank's export of a source as one AddPeer payload (rank_export takes one out)."""
    return json.dumps([base64.b64encode(data).decode() for data in ranks]).encode()


def rank_export(export: bytes, rank: int) -> bytes:
    """Rank `rank`'s export from pack_rank_exports' bytes (ValueError when it has none)."""
    try:
        ranks = json.loads(export)
        return base64.b64decode(ranks[rank])
    except (IndexError, TypeError, ValueError) as exc:
        raise ValueError(f"no export for rank {rank}: {exc}") from exc

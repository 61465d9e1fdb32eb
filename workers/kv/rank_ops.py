"""What rank 0 asks of every rank's share of the KV cache, carried in the step it broadcasts.

Under TP each rank holds its KV heads of every block, so a KV transfer is one transfer per
rank. Rank 0 lists the work as `KVRankOp`s; the executor puts their encoding into the STEP it
broadcasts (a step may carry no model inputs, only ops) and every rank, rank 0 included,
hands them to its `RankKV` in the same order before running the model. The TP control
protocol (parallel/messages.py) sees only opaque bytes: it has no KV-specific commands.

    Setup(backend, layout)      every rank creates its `backend` connector (connectors.py)
                                over its cache; rank 0 gets every rank's export (rank order)
    AddPeer(b, slot, export)    rank r opens the source's rank r share under `slot`; rank 0
                                gets the ranks that failed
    RemovePeer(b, slot)         every rank drops `slot`
    Load(b, transfer, slot, ..) every rank starts its share of a transfer from `slot`; rank 0
                                gets the group's TransferOutcome so far
    Poll(b, transfer, finish)   every rank checks (finish: ends) its share; the outcome
    GatherBlocks(block_ids)     rank 0 gets every rank's heads of the blocks, joined
    ScatterBlocks(block_ids)    rank 0 writes joined heads into the blocks on every rank

Invariant: every rank runs the same ops in the same order, and every op that answers does
so through a collective on the control group, so a failure on one rank is an answer on all
and the group stays in step. After Load or Poll settles a transfer (done everywhere or
failed anywhere), every rank forgets it, first ending its share if still running: once
settled, nothing of the transfer writes on any rank.
"""
from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tandem.common.kv_layout import KVLayout
from tandem.common.logging import get_logger
from tandem.workers.kv.block_payload import KVCaches
from tandem.workers.kv.kv_shards import (join_shares, layer_widths, local_share, share_shape,
                                         split_joined, write_local_share)
from tandem.workers.kv.connectors import rank_connector_class
from tandem.workers.kv.rank_connector import RankConnector
from tandem.workers.kv.rank_transfers import FAILED, TransferOutcome
from tandem.workers.parallel.control_gathers import all_gather_bytes, all_gather_ints

logger = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Setup:
    backend: str
    layout: KVLayout


@dataclass(frozen=True, slots=True)
class AddPeer:
    backend: str
    slot: int
    export: bytes  # the source's export as its backend encodes it (kv_exports.to_bytes)


@dataclass(frozen=True, slots=True)
class RemovePeer:
    backend: str
    slot: int


@dataclass(frozen=True, slots=True)
class Load:
    backend: str
    transfer: int
    slot: int
    src_ids: list[int]
    dst_ids: list[int]
    timeout: float


@dataclass(frozen=True, slots=True)
class Poll:
    backend: str
    transfer: int
    finish: bool = False


@dataclass(frozen=True, slots=True)
class GatherBlocks:
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class ScatterBlocks:
    block_ids: list[int]
    joined: KVCaches | None = field(default=None, compare=False)  # rank 0's only: not sent


KVRankOp = Setup | AddPeer | RemovePeer | Load | Poll | GatherBlocks | ScatterBlocks
_OPS = {cls.__name__: cls for cls in (Setup, AddPeer, RemovePeer, Load, Poll, GatherBlocks,
                                      ScatterBlocks)}


def encode_ops(ops: list[KVRankOp]) -> bytes:
    """The ops as the STEP broadcast carries them (JSON; bytes in base64; ScatterBlocks'
    tensors travel by the scatter itself)."""
    return json.dumps([[type(op).__name__, _fields(op)] for op in ops]).encode()


def decode_ops(data: bytes) -> list[KVRankOp]:
    """The inverse of encode_ops; ValueError for bytes that are not ops."""
    try:
        return [_build(name, fields) for name, fields in json.loads(data)]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not KV rank ops: {exc}") from exc


def _fields(op: KVRankOp) -> dict:
    fields = {}
    for f in dataclasses.fields(op):
        value = getattr(op, f.name)
        if f.name == "joined":
            continue
        if isinstance(value, bytes):
            value = {"b64": base64.b64encode(value).decode()}
        elif isinstance(value, KVLayout):
            value = dataclasses.asdict(value)
        fields[f.name] = value
    return fields


def _build(name: str, fields: dict) -> KVRankOp:
    cls = _OPS[name]
    for key, value in fields.items():
        if isinstance(value, dict) and "b64" in value:
            fields[key] = base64.b64decode(value["b64"])
        elif key == "layout":
            fields[key] = KVLayout(**value)
    return cls(**fields)


class RankKV:
    """One rank's end of the KV ops: its cache, and its connectors (backend -> the one Setup
    made; auto may set up cuda-ipc and nixl both)."""

    def __init__(self, kv_caches: KVCaches, device: torch.device, rank: int,
                 world_size: int) -> None:
        self.kv_caches = kv_caches
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.connectors: dict[str, RankConnector] = {}

    def run(self, ops: list[KVRankOp], group: ProcessGroup | None) -> list:
        """Runs the ops in order (collectives on `group`, the control group); rank 0 gets an
        answer per op (None where the op has none), the others answers of no meaning."""
        return [self._run(op, group) for op in ops]

    def _run(self, op: KVRankOp, group: ProcessGroup | None):
        if isinstance(op, Setup):
            return self._gather_bytes(self._setup(op), group)
        if isinstance(op, AddPeer):
            connector = self.connectors.get(op.backend)
            ok = connector is not None and connector.add_peer(op.slot, op.export)
            return [rank for rank, flag in enumerate(self._gather_ints(0 if ok else 1, group))
                    if flag]
        if isinstance(op, RemovePeer):
            connector = self.connectors.get(op.backend)
            if connector is not None:
                connector.remove_peer(op.slot)
            return None
        if isinstance(op, Load):
            connector = self.connectors.get(op.backend)
            status = FAILED if connector is None else connector.start_load(
                op.transfer, op.slot, op.src_ids, op.dst_ids, op.timeout)
            return self._settle(connector, op.transfer, status, group)
        if isinstance(op, Poll):
            connector = self.connectors.get(op.backend)
            status = FAILED if connector is None else connector.poll(op.transfer, op.finish)
            return self._settle(connector, op.transfer, status, group)
        if isinstance(op, GatherBlocks):
            return self._gather_blocks(op.block_ids)
        if isinstance(op, ScatterBlocks):
            return self._scatter_blocks(op.block_ids, op.joined)
        raise ValueError(f"unknown KV rank op {op!r}")

    def _setup(self, op: Setup) -> bytes:
        """This rank's connector over its cache (once per process: a cache stays registered
        for its life) and its export; b"" when the backend refused (logged)."""
        connector = self.connectors.get(op.backend)
        if connector is None:
            try:
                cls = rank_connector_class(op.backend)
            except (ImportError, ValueError) as exc:
                logger.error("rank %d: no %s connector: %s", self.rank, op.backend, exc)
                return b""
            connector = self.connectors[op.backend] = cls(self.kv_caches, self.device,
                                                          self.rank)
        return connector.setup(dataclasses.replace(op.layout, tp_rank=self.rank))

    def _settle(self, connector: RankConnector | None, transfer: int, status: int,
                group: ProcessGroup | None) -> TransferOutcome:
        """Every rank's status to all; once settled, every rank forgets the transfer."""
        outcome = TransferOutcome(self._gather_ints(status, group))
        if outcome.settled and connector is not None:
            connector.settle(transfer, outcome.done)
        return outcome

    def _gather_blocks(self, block_ids: list[int]) -> KVCaches | None:
        share = local_share(self.kv_caches, block_ids)
        if self.world_size == 1:
            return join_shares([share], layer_widths(self.kv_caches))
        if self.rank != 0:
            dist.gather(share, None, dst=0)
            return None
        shares = [torch.empty_like(share) for _ in range(self.world_size)]
        dist.gather(share, shares, dst=0)
        return join_shares(shares, layer_widths(self.kv_caches))

    def _scatter_blocks(self, block_ids: list[int], joined: KVCaches | None) -> None:
        if self.rank == 0:
            shares = [s.to(self.device) for s in split_joined(joined, self.world_size)]
            mine = torch.empty_like(shares[0])
            if self.world_size > 1:
                dist.scatter(mine, shares, src=0)
            else:
                mine = shares[0]
        else:
            like = self.kv_caches[0][0]
            mine = torch.empty(share_shape(self.kv_caches, len(block_ids)), dtype=like.dtype,
                               device=like.device)
            dist.scatter(mine, None, src=0)
        write_local_share(self.kv_caches, block_ids, mine)

    def _gather_ints(self, value: int, group: ProcessGroup | None) -> list[int]:
        return [value] if self.world_size == 1 else all_gather_ints(value, group)

    def _gather_bytes(self, data: bytes, group: ProcessGroup | None) -> list[bytes]:
        return [data] if self.world_size == 1 else all_gather_bytes(data, group)

    def close(self) -> None:
        """Releases this rank's connector (at shutdown, after the last step)."""
        connectors, self.connectors = self.connectors, {}
        for connector in connectors.values():
            connector.close()

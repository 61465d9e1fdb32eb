"""The `mori` KV transfer backend: AMD MoRI-IO (`mori.io.IOEngine`), one-sided RDMA (or XGMI)
READs of a prefill worker's registered KV cache by the decode worker.

UNTESTED: written against MoRI-IO's Python API (IOEngine, EngineDesc / MemoryDesc pack and
unpack, batch_read with a TransferStatus) without an AMD GPU to run it on; no test runs it.
Only `--kv-transfer mori` refusing to start where mori is not installed is tested.

This module is the whole backend: the worker-side half on every rank (RankMori, a
rank_connector.RankConnector); rank 0's side is the generic connector.KVConnector, which
reaches the ranks through the step broadcast, so one rank and a TP group go the same way
(rank r of the receiver READs rank r of the source). `mori` is imported only when a worker
creates an engine, and only on ROCm.

    connector = RankMori(kv_caches, device, rank)
    export = connector.setup(layout)       # an IOEngine over this rank's cache; b"": refused
    connector.add_peer(slot, export)       # the source's engine and memory descriptors
    connector.start_load(transfer, slot, src_ids, dst_ids, timeout) -> status
    connector.poll(transfer, finish) -> status;  connector.settle(transfer, done)

Invariants (the lease rules of kv_transfer_service.py, as for nixl): the source registers its
whole cache once and never frees it; the receiver READs only blocks LeaseKV returned, only
while the lease lasts, into blocks it reserved and has not activated. A READ cannot be
cancelled once posted: finishing or settling a failed transfer waits until no READ of it is in
progress, so no byte lands after the transfer is settled.
"""
from __future__ import annotations

import base64
import importlib.util
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass

import torch

from tandem.common.kv_layout import KVLayout
from tandem.common.logging import get_logger
from tandem.common.ports import free_port
from tandem.workers.kv.block_payload import KVCaches
from tandem.workers.kv.nixl_backend import block_runs
from tandem.workers.kv.rank_connector import rank_export
from tandem.workers.kv.rank_transfers import DONE, FAILED, PENDING

logger = get_logger(__name__)


def unavailable_reason() -> str | None:
    if importlib.util.find_spec("mori") is None:
        return ("MoRI-IO is not installed (AMD's mori package, ROCm only; this backend is "
                "untested)")
    if torch.version.hip is None:
        return "MoRI-IO needs a ROCm build of torch"
    return None


def wanted_in_auto(device_type: str) -> bool:
    """auto runs mori between GPU workers on ROCm."""
    return device_type == "cuda" and torch.version.hip is not None


@dataclass(frozen=True)
class _Tensor:
    """Where one cache tensor's blocks are: block b is at offset + b * stride in region
    `region` (a registered storage), block_bytes long."""

    region: int
    offset: int
    stride: int
    block_bytes: int
    num_blocks: int


@dataclass
class _Peer:
    engine_key: str
    regions: list  # mori.io.MemoryDesc per registered region
    tensors: list[_Tensor]


class RankMori:
    def __init__(self, kv_caches: KVCaches, device: torch.device | None = None,
                 rank: int = 0) -> None:
        self.kv_caches = kv_caches
        self.device = device
        self.rank = rank
        self._engine = None
        self._regions: list = []  # MemoryDesc of each registered storage
        self._tensors: list[_Tensor] = []
        self._export = b""
        self._peers: dict[int, _Peer] = {}
        self._engines: dict[str, int] = {}  # remote engine key -> slots using it
        # transfer -> (its TransferStatuses, deadline on time.monotonic())
        self._loads: dict[int, tuple[list, float]] = {}

    def setup(self, layout: KVLayout) -> bytes:
        """Creates the IOEngine and registers every storage of the cache, once per process.
        (The layout needs no export: ExportConnector checks it against the receiver's.)"""
        if self._engine is not None:
            return self._export
        try:
            from mori import io as mori_io

            self._mori = mori_io
            host = socket.gethostbyname(socket.gethostname())
            config = mori_io.IOEngineConfig(host=host, port=free_port(host))
            key = (f"tandem-{socket.gethostname()}-{os.getpid()}-{self.rank}-"
                   f"{uuid.uuid4().hex[:8]}")
            engine = mori_io.IOEngine(key, config)
            engine.create_backend(mori_io.BackendType.RDMA)
            self._tensors, storages = _describe(self.kv_caches)
            self._regions = [engine.register_torch_tensor(_whole_storage(t)) for t in storages]
        except Exception as exc:  # mori raises its own types
            logger.error("rank %d: no MoRI-IO engine: %s", self.rank, exc)
            return b""
        self._engine = engine
        self._export = json.dumps({
            "engine": _b64(engine.get_engine_desc().pack()),
            "regions": [_b64(r.pack()) for r in self._regions],
            "tensors": [list(vars(t).values()) for t in self._tensors]}).encode()
        return self._export

    def add_peer(self, slot: int, export: bytes) -> bool:
        self.remove_peer(slot)
        try:
            if self._engine is None:
                raise ValueError("this rank has no MoRI-IO engine")
            fields = json.loads(rank_export(export, self.rank))
            tensors = [_Tensor(*t) for t in fields["tensors"]]
            if len(tensors) != len(self._tensors) or any(
                    r.block_bytes != t.block_bytes for r, t in zip(tensors, self._tensors)):
                raise ValueError("the source's cache tensors do not match this worker's")
            desc = self._mori.EngineDesc.unpack(base64.b64decode(fields["engine"]))
            regions = [self._mori.MemoryDesc.unpack(base64.b64decode(r))
                       for r in fields["regions"]]
            if desc.key not in self._engines:
                self._engine.register_remote_engine(desc)
            self._engines[desc.key] = self._engines.get(desc.key, 0) + 1
        except Exception as exc:
            logger.warning("rank %d: opening MoRI-IO source %d failed: %s", self.rank, slot,
                           exc)
            return False
        self._peers[slot] = _Peer(desc.key, regions, tensors)
        return True

    def remove_peer(self, slot: int) -> None:
        peer = self._peers.pop(slot, None)
        if peer is None:
            return
        users = self._engines.pop(peer.engine_key, 0) - 1
        if users > 0:
            self._engines[peer.engine_key] = users
        # The remote engine stays registered: MoRI-IO keys are unique per process start, so
        # a restarted source comes back under a new key.

    def start_load(self, transfer: int, slot: int, src_ids: list[int], dst_ids: list[int],
                   timeout: float) -> int:
        peer = self._peers.get(slot)
        if peer is None or self._engine is None:
            logger.warning("rank %d: MoRI-IO READ from unopened source %d", self.rank, slot)
            return FAILED
        try:
            if len(src_ids) != len(dst_ids) or any(
                    not 0 <= b < t.num_blocks for t in peer.tensors for b in src_ids) or any(
                    not 0 <= b < t.num_blocks for t in self._tensors for b in dst_ids):
                raise ValueError("block ids out of range")
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the blocks' last writers
            statuses = []
            runs = block_runs(src_ids, dst_ids)
            for local, remote in zip(self._tensors, peer.tensors):
                whole = local.stride == local.block_bytes and remote.stride == remote.block_bytes
                rows = runs if whole else block_runs(src_ids, dst_ids, merge=False)
                sizes = [int(n) * local.block_bytes for n in rows[:, 2]]
                local_offsets = [local.offset + int(b) * local.stride for b in rows[:, 1]]
                remote_offsets = [remote.offset + int(b) * remote.stride for b in rows[:, 0]]
                statuses.append(self._engine.batch_read(
                    self._regions[local.region], local_offsets, peer.regions[remote.region],
                    remote_offsets, sizes, self._engine.allocate_transfer_uid()))
        except Exception as exc:
            logger.warning("rank %d: MoRI-IO READ from source %d failed: %s", self.rank, slot,
                           exc)
            return FAILED
        self._loads[transfer] = (statuses, time.monotonic() + timeout)
        return self.poll(transfer, False)

    def poll(self, transfer: int, finish: bool) -> int:
        load = self._loads.get(transfer)
        if load is None:
            return FAILED
        statuses, deadline = load
        if finish:
            _wait_out(statuses)
            return FAILED
        if any(s.Failed() for s in statuses):
            return FAILED
        if all(s.Succeeded() for s in statuses):
            return DONE
        return FAILED if time.monotonic() > deadline else PENDING

    def settle(self, transfer: int, done: bool) -> None:
        load = self._loads.pop(transfer, None)
        if load is not None and not done:
            _wait_out(load[0])

    def close(self) -> None:
        if self._engine is not None:
            for region in self._regions:
                self._engine.deregister_memory(region)
            self._engine = None


def _describe(kv_caches: KVCaches) -> tuple[list[_Tensor], list[torch.Tensor]]:
    """Every cache tensor's blocks relative to its storage, and one tensor per storage."""
    storages: dict[int, int] = {}
    first: list[torch.Tensor] = []
    tensors = []
    for t in (cache for layer in kv_caches for cache in layer):
        if not t[0].is_contiguous():
            raise ValueError(f"a cache tensor of strides {t.stride()} splits its blocks")
        base = t.untyped_storage().data_ptr()
        if base not in storages:
            storages[base] = len(first)
            first.append(t)
        size = t.element_size()
        tensors.append(_Tensor(storages[base], t.storage_offset() * size, t.stride(0) * size,
                               t[0].numel() * size, t.shape[0]))
    return tensors, first


def _whole_storage(t: torch.Tensor) -> torch.Tensor:
    """A contiguous uint8 view of t's whole storage (IOEngine registers contiguous tensors)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _wait_out(statuses: list) -> None:
    """Returns once no READ of the transfer is in progress (MoRI-IO cannot cancel one)."""
    while any(s.InProgress() for s in statuses):
        time.sleep(1e-4)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


RANK_CONNECTOR = RankMori

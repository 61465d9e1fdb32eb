"""The `nixl` KV transfer backend: the decode worker READs a prefill worker's pinned blocks
through NVIDIA NIXL (UCX underneath: RDMA or TCP between hosts, shared memory or CUDA IPC on
one host), from host ("DRAM") and GPU ("VRAM") caches alike.

    agent = NixlKVAgent(kv_caches, layout)        # every nixl worker, once: registers its cache
    agent.export()                                # prefill: -> NixlAgentExport (cached)
    peer = agent.add_peer(export)                 # decode: once per peer export_id
    num_bytes = await agent.read_blocks(peer, src_ids, dst_ids, timeout)  # per handle
    read = agent.post_read(peer, src_ids, dst_ids, timeout)  # a TP rank: polled by rank 0
    read.check() -> done?; read.num_bytes; read.cancel()
    agent.remove_peer(peer)                       # the peer restarted (new export_id)
    agent.close()                                 # at shutdown

Invariants (the lease/pin rules of kv_transfer_service.py apply unchanged):

* The prefill worker registers its whole cache once, at start-up, and never frees it: the
  registered regions and the addresses it exports stay valid for the process's life. A
  restarted source has a new agent name and export_id; a receiver never reads through the
  metadata of an export_id other than the handle's.
* Blocks of a pinned handle are complete (the prefill step that pinned them read its sampled
  token back to the host) and nobody writes them until ReleaseKV or the lease ends. So the
  decode worker READs only blocks that LeaseKV returned, only while that lease lasts (the wait
  for completion is capped by it), and releases after the READ completed.
* The decode worker writes only blocks it reserved and has not yet activated; read_blocks
  returns only after NIXL reported the READ done, or after cancelling it (release of an
  unfinished transfer aborts it), so no byte lands after the request was aborted and its
  blocks freed.
* Every NIXL call is made on the agent's own thread (nixl_agent.py), which also runs each
  READ from post to release: neither the event loop nor the engine thread waits on one.

nixl is imported only when an agent is created (nixl_agent.py): importing this module needs
no NIXL.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from tandem.common.kv_exports import NixlAgentExport, NixlEndpoint, TensorBlocks
from tandem.common.logging import get_logger
from tandem.workers.kv.block_payload import KVCaches
from tandem.common.kv_layout import KVLayout
from tandem.workers.kv.nixl_agent import MEM_TYPES, NixlAgent, NixlUnavailable, is_installed
from tandem.workers.kv.transport import KVTransferFailed

__all__ = ["NixlKVAgent", "NixlPeer", "NixlUnavailable", "PostedRead",
           "TensorBlocks", "block_runs",
           "descriptor_rows", "is_installed", "registration_regions"]
logger = get_logger(__name__)


@dataclass
class NixlPeer:
    """Decode side: a source agent loaded into this worker's agent."""

    agent_name: str  # as NIXL knows it (NixlAgent.load_peer's answer)
    export_id: str
    mem_type: str
    tensors: list[TensorBlocks]  # layer-major, as cuda_ipc.flat_caches
    slot: int = -1  # a TP worker's: where its ranks keep the source (nixl_ranks.py)


def tensor_blocks(tensor: torch.Tensor) -> TensorBlocks:
    """A cache tensor [num_blocks, ...] whose every block is contiguous (ValueError if not)."""
    if tensor.dim() < 2 or not tensor[0].is_contiguous():
        raise ValueError(f"nixl: a cache tensor of shape {tuple(tensor.shape)} and strides "
                         f"{tensor.stride()} does not keep each block contiguous")
    block_bytes = tensor[0].numel() * tensor.element_size()
    stride_bytes = tensor.stride(0) * tensor.element_size()
    if stride_bytes < block_bytes:
        raise ValueError(f"nixl: cache blocks overlap (stride {stride_bytes} < {block_bytes} "
                         f"bytes)")
    device_id = (tensor.device.index or 0) if tensor.device.type == "cuda" else 0
    return TensorBlocks(tensor.data_ptr(), stride_bytes, block_bytes, tensor.shape[0],
                        device_id)


def whole_blocks(tensors: list[TensorBlocks]) -> TensorBlocks | None:
    """The cache tensors as one, when they tile a block-major cache (ModelRunner's layout):
    tensor i's block b starts at base + b * stride + i * block_bytes and the tensors fill the
    stride, so a block of every tensor is one contiguous range (one descriptor instead of one
    per tensor; both ends must tile for the rows to pair up). None otherwise."""
    first = tensors[0]
    stride = first.block_stride_bytes
    for i, t in enumerate(tensors):
        if (t.block_bytes != first.block_bytes or t.block_stride_bytes != stride
                or t.num_blocks != first.num_blocks or t.device_id != first.device_id
                or t.base_address != first.base_address + i * first.block_bytes):
            return None
    if len(tensors) * first.block_bytes != stride:
        return None
    return TensorBlocks(first.base_address, stride, stride, first.num_blocks, first.device_id)


def registration_regions(tensors: list[TensorBlocks], storages: list[int]
                         ) -> list[tuple[int, int, int]]:
    """(address, bytes, device id) covering every tensor's blocks. Tensors of one storage
    (storages[i]: tensor i's storage, e.g. its data_ptr) share one region, so caches allocated
    as slices of one stack register once; tensors of different storages never share one, as
    a VRAM region must not straddle two allocations."""
    spans: dict[tuple[int, int], list[int]] = {}
    for t, storage in zip(tensors, storages, strict=True):
        end = t.base_address + (t.num_blocks - 1) * t.block_stride_bytes + t.block_bytes
        span = spans.setdefault((t.device_id, storage), [t.base_address, end])
        span[0], span[1] = min(span[0], t.base_address), max(span[1], end)
    return [(start, end - start, device_id) for (device_id, _), (start, end) in spans.items()]


def block_runs(src_ids: list[int], dst_ids: list[int], merge: bool = True) -> np.ndarray:
    """[R, 3] int64 rows (first source block, first destination block, length): maximal runs
    where both ids go up by one together (merge=False: one row per block)."""
    src = np.asarray(src_ids, dtype=np.int64)
    dst = np.asarray(dst_ids, dtype=np.int64)
    if src.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if merge:
        breaks = (np.diff(src) != 1) | (np.diff(dst) != 1)
        starts = np.flatnonzero(np.concatenate(([True], breaks)))
    else:
        starts = np.arange(src.size)
    lengths = np.diff(np.append(starts, src.size))
    return np.stack([src[starts], dst[starts], lengths], axis=1)


def descriptor_rows(tensors: list[TensorBlocks], first_blocks: np.ndarray,
                    lengths: np.ndarray) -> np.ndarray:
    """[T * R, 3] uint64 NIXL descriptors (address, bytes, device id): for each tensor, for
    each run, the run's blocks (contiguous when the run is longer than one block)."""
    base = np.array([t.base_address for t in tensors], dtype=np.uint64)[:, None]
    stride = np.array([t.block_stride_bytes for t in tensors], dtype=np.uint64)[:, None]
    size = np.array([t.block_bytes for t in tensors], dtype=np.uint64)[:, None]
    device = np.array([t.device_id for t in tensors], dtype=np.uint64)[:, None]
    first = first_blocks.astype(np.uint64)[None, :]
    count = lengths.astype(np.uint64)[None, :]
    rows = np.stack(np.broadcast_arrays(base + first * stride, count * size, device), axis=-1)
    return np.ascontiguousarray(rows.reshape(-1, 3))


class NixlKVAgent:
    """One NIXL agent per worker over its own cache: exports it (prefill) and READs peers'
    blocks into it (decode)."""

    def __init__(self, kv_caches: KVCaches, layout: KVLayout) -> None:
        tensors = [cache for caches in kv_caches for cache in caches]
        self.layout = layout
        self.device = tensors[0].device
        self.mem_type = "VRAM" if self.device.type == "cuda" else "DRAM"
        self.tensors = [tensor_blocks(t) for t in tensors]
        self.export_id = uuid.uuid4().hex
        name = f"tandem-{socket.gethostname()}-{os.getpid()}-{self.export_id[:8]}"
        cuda_device = (self.device.index or 0) if self.device.type == "cuda" else None
        self._agent = NixlAgent(name, cuda_device)
        started = time.monotonic()
        regions = registration_regions(
            self.tensors, [t.untyped_storage().data_ptr() for t in tensors])
        try:
            self._registered = self._agent.register(regions, self.mem_type)
        except Exception as exc:  # NIXL raises its own exception types
            self._agent.close()
            raise NixlUnavailable(f"registering the KV cache ({len(regions)} {self.mem_type} "
                                  f"regions) with NIXL failed: {exc}") from exc
        self.name = name
        self.endpoint = NixlEndpoint(agent_name=name, export_id=self.export_id)
        self._export: NixlAgentExport | None = None
        # NIXL keeps one copy of a peer's metadata per agent name: a peer added twice (two
        # addresses of one source, two slots of a TP rank) is unloaded when the last goes.
        self._peer_refs: dict[str, int] = {}
        logger.info("NIXL agent %s: registered %d cache tensors as %d %s regions (%.2f GiB) "
                    "in %.3f s", name, len(tensors), len(regions), self.mem_type,
                    sum(r[1] for r in regions) / 2**30, time.monotonic() - started)

    def export(self) -> NixlAgentExport:
        if self._export is None:
            self._export = NixlAgentExport(
                endpoint=self.endpoint, layout=self.layout,
                agent_metadata=self._agent.metadata(), mem_type=self.mem_type,
                tensors=tuple(self.tensors))
        return self._export

    def add_peer(self, export: NixlAgentExport) -> NixlPeer:
        """Loads a source's agent. ValueError when its cache cannot fill this one block for
        block; NixlUnavailable when NIXL refuses its metadata."""
        export.layout.check_readable_by(self.layout)
        if export.mem_type not in MEM_TYPES:
            raise ValueError(f"nixl: the source's memory type {export.mem_type!r} is not "
                             f"one of {', '.join(MEM_TYPES)}")
        remote = list(export.tensors)
        if len(remote) != len(self.tensors):
            raise ValueError(f"nixl: the source exports {len(remote)} cache tensors, this "
                             f"worker has {len(self.tensors)}")
        for i, (r, local) in enumerate(zip(remote, self.tensors)):
            if r.block_bytes != local.block_bytes or r.num_blocks < 1 or (
                    r.block_stride_bytes < r.block_bytes):
                raise ValueError(f"nixl: cache tensor {i}: the source's blocks are "
                                 f"{r.block_bytes} bytes every {r.block_stride_bytes} "
                                 f"({r.num_blocks} blocks), this worker's "
                                 f"{local.block_bytes}")
        try:
            name = self._agent.load_peer(export.agent_metadata)
        except Exception as exc:
            raise NixlUnavailable(f"loading NIXL agent {export.endpoint.agent_name!r} "
                                  f"failed: {exc}") from exc
        self._peer_refs[name] = self._peer_refs.get(name, 0) + 1
        return NixlPeer(name, export.endpoint.export_id, export.mem_type, remote)

    def remove_peer(self, peer: NixlPeer) -> None:
        refs = self._peer_refs.pop(peer.agent_name, 0) - 1
        if refs > 0:  # another NixlPeer still reads through this agent's metadata
            self._peer_refs[peer.agent_name] = refs
            return
        try:
            self._agent.unload_peer(peer.agent_name)
        except Exception as exc:  # already gone; nothing is read through it any more
            logger.warning("removing NIXL agent %s: %s", peer.agent_name, exc)

    async def read_blocks(self, peer: NixlPeer, src_ids: list[int], dst_ids: list[int],
                          timeout: float) -> int:
        """Local block dst_ids[i] of every cache tensor <- the peer's block src_ids[i], by one
        NIXL READ; returns the bytes read once it completed. Raises ValueError on bad ids and
        KVTransferFailed when the READ fails or outlasts `timeout` seconds. A cancelled
        caller cancels the READ and returns only once no byte can land any more."""
        rows = self._rows(peer, src_ids, dst_ids)
        if rows is None:
            return 0
        if self.device.type == "cuda":  # kernels queued before the blocks were reserved
            await asyncio.to_thread(torch.cuda.current_stream(self.device).synchronize)
        read = self._start(peer, rows, len(src_ids), timeout)
        try:
            await asyncio.wrap_future(read.future)
        except asyncio.CancelledError:
            read.cancel()  # waits (on the loop) for a READ already inside NIXL's post
            raise
        return read.num_bytes

    def post_read(self, peer: NixlPeer, src_ids: list[int], dst_ids: list[int],
                  timeout: float) -> PostedRead:
        """read_blocks for a caller that polls instead of waiting (a TP rank's command loop,
        between engine steps): the READ starts on the agent's thread now; PostedRead.check
        says whether it is over. Raises ValueError on bad ids."""
        rows = self._rows(peer, src_ids, dst_ids)
        if rows is None:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(None)
            return PostedRead(done, threading.Event(), 0)
        if self.device.type == "cuda":  # kernels queued before the blocks were reserved
            torch.cuda.current_stream(self.device).synchronize()
        return self._start(peer, rows, len(src_ids), timeout)

    def _rows(self, peer: NixlPeer, src_ids: list[int], dst_ids: list[int]):
        """(local rows, remote rows) of NIXL descriptors for the blocks, None for no block;
        ValueError on bad ids."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"nixl: {len(src_ids)} source blocks for {len(dst_ids)} "
                             f"destination blocks")
        _check_ids("source", src_ids, min(t.num_blocks for t in peer.tensors))
        _check_ids("destination", dst_ids, min(t.num_blocks for t in self.tensors))
        if not src_ids:
            return None
        local, remote = self.tensors, peer.tensors
        local_whole, remote_whole = whole_blocks(local), whole_blocks(remote)
        if local_whole is not None and remote_whole is not None:  # both block-major
            local, remote = [local_whole], [remote_whole]
        merge = all(t.block_stride_bytes == t.block_bytes for t in (*remote, *local))
        runs = block_runs(src_ids, dst_ids, merge)
        return (descriptor_rows(local, runs[:, 1], runs[:, 2]),
                descriptor_rows(remote, runs[:, 0], runs[:, 2]))

    def _start(self, peer: NixlPeer, rows, num_blocks: int, timeout: float) -> PostedRead:
        local_rows, remote_rows = rows
        what = (f"NIXL READ of {num_blocks} blocks ({len(local_rows)} descriptors) from "
                f"agent {peer.agent_name}")
        cancelled = threading.Event()
        future = self._agent.start_read(local_rows, self.mem_type, remote_rows,
                                        peer.mem_type, peer.agent_name, timeout, cancelled,
                                        what)
        return PostedRead(future, cancelled,
                          num_blocks * sum(t.block_bytes for t in self.tensors))

    def close(self) -> None:
        """Deregisters the cache, at shutdown (a peer's READ in flight then fails, as it would
        when the process exits), and stops the agent's thread."""
        try:
            self._agent.deregister(self._registered)
        except Exception as exc:  # shutting down anyway
            logger.warning("NIXL agent %s: deregistering the cache failed: %s", self.name, exc)
        self._agent.close()


class PostedRead:
    """One READ running on its agent's thread. check() is True once it is done and raises
    KVTransferFailed when it failed or outlasted its timeout; cancel() stops an unfinished
    READ and returns once no byte can land any more (a finished or failed one is left as
    it is)."""

    def __init__(self, future: concurrent.futures.Future, cancelled: threading.Event,
                 num_bytes: int) -> None:
        self.future = future
        self._cancelled = cancelled
        self.num_bytes = num_bytes

    def check(self) -> bool:
        if not self.future.done():
            return False
        try:
            self.future.result()
        except concurrent.futures.CancelledError as exc:  # dropped before its turn
            raise KVTransferFailed("NIXL READ cancelled before it started") from exc
        return True

    def cancel(self) -> None:
        self._cancelled.set()
        try:
            self.future.result()
        except BaseException:  # failed or cancelled: either way over
            pass


def _check_ids(side: str, ids: list[int], num_blocks: int) -> None:
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"nixl: {side} block {bad[0]} is outside [0, {num_blocks})")

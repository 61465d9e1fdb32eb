"""Decode side of the KV seam: pull one handle into reserved blocks by the chosen backend.

    receiver = KVReceiver(mode, layout, blocks, kv_caches, device, tp_size,
                          nixl_agent, ranks, connectors)                  # kv/startup.py
    num_bytes, backend = await receiver.pull(source, address, handle, block_ids, start_block,
                                             timeout)     # source: a kv.source.KVSource

The caller has already checked the handle's layout (a mismatch is refused before any block is
reserved) and releases the handle after pull returned. pull returns only after the blocks are
written (cuda-ipc: its copy's event completed), so the caller may activate the request.

cuda-ipc per peer (source address): ExportKVCache once, map the cache once and reuse the
mapping for every handle whose export_id matches; a peer whose mapping failed is not tried
again until its export_id changes (auto mode falls back to nixl or grpc for it, logged once).
One rank maps it here (open_peer, a BlockCopier; copies go out coalesced on a copy stream);
a TP group maps it on every rank (rank_group.RankGroupKV: a slot per source) and every rank
copies its heads on its copy stream, started and polled between engine steps (ipc_ranks.py).

nixl: nixl_receiver.NixlReceiver (the source's agent loaded once per export_id; per handle
LeaseKV and one NIXL READ; a TP group loads and READs on every rank, nixl_ranks.py);
a source whose agent did not load gets grpc in auto mode.

connector backends (connector.KVConnector, e.g. mori): the one the mode names, or in auto each
the handle offers and this worker runs, after cuda-ipc and nixl and before grpc.
"""
from __future__ import annotations

import asyncio
import time

import torch

from tandem.common.kv_exports import CudaIpcExport, KVHandle, to_bytes
from tandem.common.kv_layout import KVLayout
from tandem.common.logging import get_logger
from tandem.workers.kv import transport
from tandem.workers.kv.block_access import KVBlockAccess
from tandem.workers.kv.block_payload import KVCaches
from tandem.workers.kv.cuda_ipc import CudaIpcUnavailable
from tandem.workers.kv.source import KVSource

logger = get_logger(__name__)

# A handle's own lease is used without renewal only with this much of it left; a copy takes
# milliseconds, so this leaves room for a stalled event loop.
LEASE_MARGIN_SECONDS = 2.0


class KVReceiver:
    def __init__(self, mode: str, layout: KVLayout, blocks: KVBlockAccess, kv_caches: KVCaches,
                 device: torch.device, tp_size: int, nixl_agent=None, ranks=None,
                 connectors: dict | None = None) -> None:
        """ranks: a rank_group.RankGroupKV, needed for cuda-ipc when tp_size > 1 (every rank
        maps and copies its share; the worker set the ranks up for cuda-ipc at start-up).
        connectors: name -> connector.KVConnector this worker runs."""
        transport.check_kv_transfer(mode, device.type)
        self.mode = mode
        self.layout = layout
        self.blocks = blocks
        self.device = device
        self.tp_size = tp_size
        self._local: list[torch.Tensor] | None = None
        self._copies = None  # an ipc_copies.CoalescedCopies on this worker's copy stream
        self._peers: dict[str, _LocalPeer | _RankGroupPeer] = {}  # address -> its mapping
        self._slots: dict[str, int] = {}  # TP: address -> slot of its mapping on the ranks
        self._ranks = ranks.backend(transport.CUDA_IPC) if ranks is not None else None
        self.connectors = connectors or {}
        self._failed: dict[str, str] = {}  # address -> export_id whose mapping failed
        self._logged: set[str] = set()  # peers whose grpc fallback was logged
        self._host_id = ""
        self.nixl = None  # a nixl_receiver.NixlReceiver when this worker has a NIXL agent
        if nixl_agent is not None:  # TP: a nixl_receiver.RankGroupNixl
            from tandem.workers.kv.nixl_receiver import NixlReceiver, OneRankReads

            reads = OneRankReads(nixl_agent) if tp_size == 1 else nixl_agent
            self.nixl = NixlReceiver(reads, layout, mode)
        if transport.cuda_ipc_possible(mode, device.type):
            from tandem.workers.kv import cuda_ipc

            self._host_id = cuda_ipc.host_id()
            self._local = cuda_ipc.flat_caches(kv_caches)
            if tp_size == 1:
                from tandem.workers.kv.ipc_copies import CoalescedCopies

                self._copies = CoalescedCopies(torch.cuda.Stream(device))
                # The first handoff would otherwise compile the gather inside a request's TTFT
                # (TP ranks compile theirs when their cuda-ipc connector is set up).
                cuda_ipc.BlockCopier(self._local, self._local).precompile()
            elif ranks is None:
                raise ValueError("KVReceiver: cuda-ipc under TP needs the rank group")

    async def pull(self, source: KVSource, address: str, handle: KVHandle,
                   block_ids: list[int], start_block: int,
                   timeout: float | None) -> tuple[int, str]:
        """Returns (bytes moved, backend used). Raises what the source's calls raise
        (grpc.aio.AioRpcError), ValueError, transport.KVTransportUnavailable or
        transport.KVTransferFailed; blocks may be half written then (abort the request)."""
        if self.mode in self.connectors:
            return await self._pull_connector(source, address, handle, block_ids,
                                              start_block, timeout)
        endpoint = handle.cuda_ipc
        transports = list(handle.transports)
        backend, why = self._choose(transports, endpoint)
        if backend == transport.CUDA_IPC:
            if self._failed.get(address) == endpoint.export_id:
                why = "mapping its cache failed before"
            else:
                mapped = await self._peer(source, address, endpoint.export_id, timeout)
                if mapped is not None:
                    num_bytes = await self._pull_ipc(source, mapped, handle, block_ids,
                                                     start_block, timeout)
                    return num_bytes, transport.CUDA_IPC
                why = "mapping its cache failed"
            if self.mode == transport.CUDA_IPC:
                raise transport.KVTransportUnavailable(
                    f"--kv-transfer cuda-ipc: {why} (peer {address})")
            # auto: what the handle offers besides cuda-ipc
            transports = [t for t in transports or [transport.GRPC] if t != transport.CUDA_IPC]
            backend, more = self._choose(transports, endpoint)
            why = f"cuda-ipc: {why}" + (f"; {more}" if backend == transport.GRPC else "")
        if backend == transport.NIXL:
            num_bytes, failure = await self.nixl.pull(source, address, handle, block_ids,
                                                      start_block, timeout)
            if failure is None:
                return num_bytes, transport.NIXL
            if self.mode == transport.NIXL:
                raise transport.KVTransportUnavailable(
                    f"--kv-transfer nixl: {failure} (peer {address})")
            why = f"nixl: {failure}"
        for name, connector in self.connectors.items():  # auto: what cuda-ipc and nixl left
            if name in transports:
                num_bytes, failure = await connector.pull(source, address, handle, block_ids,
                                                          start_block, timeout)
                if failure is None:
                    return num_bytes, name
                why = f"{why}; {name}: {failure}" if why else f"{name}: {failure}"
        if address not in self._logged:
            logger.info("KV from %s over grpc: %s", address, why)
            self._logged.add(address)
        num_bytes = await source.pull_blocks(handle, self.blocks, block_ids, start_block,
                                             timeout)
        return num_bytes, transport.GRPC

    async def _pull_connector(self, source, address, handle, block_ids, start_block,
                              timeout) -> tuple[int, str]:
        """--kv-transfer <connector>: that backend or the reason it cannot serve."""
        name = self.mode
        if name not in handle.transports:
            failure = f"the source does not offer {name}"
        else:
            num_bytes, failure = await self.connectors[name].pull(
                source, address, handle, block_ids, start_block, timeout)
            if failure is None:
                return num_bytes, name
        raise transport.KVTransportUnavailable(f"--kv-transfer {name}: {failure} "
                                               f"(peer {address})")

    def _choose(self, transports: list[str], endpoint) -> tuple[str, str]:
        return transport.choose_transport(
            self.mode, transports, endpoint.host_id if endpoint else "", self._host_id,
            self.device.type, nixl_ready=self.nixl is not None)

    async def _peer(self, source: KVSource, address: str, export_id: str,
                    timeout: float | None):
        known = self._peers.get(address)
        if known is not None and known.export_id == export_id:
            return known
        self._peers.pop(address, None)  # stale: the source restarted; drop the old mapping
        export = await source.export_cuda_ipc(timeout)
        if export.endpoint.export_id != export_id:
            raise ValueError(f"peer {address} exported cache {export.endpoint.export_id}, "
                             f"the handle names {export_id}: it restarted in between")
        try:
            if self.tp_size == 1:
                peer = await self._map_here(export)
            else:
                peer = await self._map_on_ranks(address, export)
        except CudaIpcUnavailable as exc:
            self._failed[address] = export_id
            log = logger.error if self.mode == transport.CUDA_IPC else logger.warning
            log("KV from %s: cuda-ipc unavailable (%s)%s", address, exc,
                "" if self.mode == transport.CUDA_IPC else "; falling back to grpc")
            return None
        logger.info("KV from %s over cuda-ipc: %s", address, peer.description)
        self._peers[address] = peer
        return peer

    async def _map_here(self, export: CudaIpcExport) -> _LocalPeer:
        from tandem.workers.kv import cuda_ipc

        mapped = await asyncio.to_thread(cuda_ipc.open_peer, export, self.device)
        copier = cuda_ipc.BlockCopier(mapped.caches, self._local)
        return _LocalPeer(mapped.export_id, copier, self._copies,
                          f"mapped {len(mapped.caches)} cache tensors on {self.device} ("
                          f"{'one gather' if copier.one_launch else 'a gather per tensor'})")

    async def _map_on_ranks(self, address: str, export: CudaIpcExport) -> _RankGroupPeer:
        if len(export.ranks) != self.tp_size:
            raise CudaIpcUnavailable(f"the source exported {len(export.ranks)} rank caches, "
                                     f"this worker has {self.tp_size} ranks")
        slot, failed = await self._ranks.add_peer(to_bytes(export), self._slots.get(address))
        self._slots[address] = slot
        if failed:
            raise CudaIpcUnavailable(f"mapping the source's cache failed on rank(s) {failed} "
                                     f"(see their logs)")
        every_rank_block_bytes = (self.layout.tp_size * self.layout.num_layers
                                  * self.layout.bytes_per_layer_block)
        return _RankGroupPeer(export.endpoint.export_id, self._ranks, slot,
                              every_rank_block_bytes,
                              f"mapped on all {self.tp_size} ranks (slot {slot})")

    async def _pull_ipc(self, source, peer, handle, block_ids, start_block, timeout) -> int:
        """Copy by cuda-ipc. The handle names its pinned blocks and their deadline on this
        host's monotonic clock; with LEASE_MARGIN_SECONDS left the copy starts at once, else
        LeaseKV renews the pin first (and returns the blocks). Copies of handles pulled in the
        same event-loop turn go out as one launch (ipc_copies.py; one rank)."""
        endpoint = handle.cuda_ipc
        if (len(endpoint.block_ids) >= handle.num_blocks and endpoint.lease_deadline_monotonic
                - time.monotonic() > LEASE_MARGIN_SECONDS):
            src_ids = list(endpoint.block_ids[start_block:handle.num_blocks])
            deadline = endpoint.lease_deadline_monotonic
        else:
            started = time.monotonic()
            lease = await source.lease(handle.handle_id, start_block, timeout)
            src_ids = list(lease.block_ids)
            deadline = started + lease.lease_seconds
        if len(src_ids) != len(block_ids):
            raise ValueError(f"KV handle {handle.handle_id}: source pinned {len(src_ids)} "
                             f"blocks from block {start_block}, receiver expected "
                             f"{len(block_ids)}")
        await peer.copy(src_ids, list(block_ids))
        if time.monotonic() >= deadline:
            raise ValueError(f"KV handle {handle.handle_id}: the copy ended after the source's "
                             f"lease; the blocks may have been reused")
        return len(src_ids) * peer.block_bytes


class _LocalPeer:
    """One rank: the source's cache mapped in this process; copies run on the copy stream."""

    def __init__(self, export_id: str, copier, copies, description: str) -> None:
        self.export_id = export_id
        self.block_bytes = copier.block_bytes
        self.description = description
        self._copier, self._copies = copier, copies

    async def copy(self, src_ids: list[int], dst_ids: list[int]) -> None:
        await self._copies.copy(self._copier, src_ids, dst_ids)


class _RankGroupPeer:
    """TP: the source mapped on every rank under `slot`; every rank copies its heads on its
    copy stream, started and polled by KV rank ops (ipc_ranks.py), so the engine keeps
    stepping while the copy runs."""

    def __init__(self, export_id: str, ranks, slot: int, block_bytes: int,
                 description: str) -> None:
        self.export_id = export_id
        self.block_bytes = block_bytes  # of every rank together
        self.description = description
        self._ranks, self._slot = ranks, slot

    async def copy(self, src_ids: list[int], dst_ids: list[int]) -> None:
        await self._ranks.load(self._slot, src_ids, dst_ids, None,
                               f"cuda-ipc copy of {len(src_ids)} blocks")

"""What the decode side's KV transfer needs of a source (prefill) worker, in Tandem's own types.

The worker's implementation is kv_transfer_service.KVPeerClient (the KVTransfer gRPC calls on
a channel to the source); the KV transfer code sees only this protocol, so it stays free of
gRPC stubs and protobuf.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from tandem.common.kv_exports import (ConnectorExport, CudaIpcExport, KVHandle, KVLease,
                                      NixlAgentExport)
from tandem.workers.kv.block_access import KVBlockAccess


class KVSource(Protocol):
    async def export_cuda_ipc(self, timeout: float | None) -> CudaIpcExport:
        """The source's cache as CUDA IPC handles (cuda-ipc)."""

    async def export_nixl(self, timeout: float | None) -> NixlAgentExport:
        """The source's NIXL agent (nixl)."""

    async def export_connector(self, backend: str, timeout: float | None) -> ConnectorExport:
        """The source's export of a connector backend (kv/connector.py)."""

    async def lease(self, handle_id: str, start_block: int, timeout: float | None) -> KVLease:
        """Renews a handle's pin; its block ids from start_block on."""

    async def pull_blocks(self, handle: KVHandle, blocks: KVBlockAccess, block_ids: list[int],
                          start_block: int, timeout: float | None) -> int:
        """grpc: streams the handle's blocks from start_block on into block_ids; the bytes."""


@dataclass(frozen=True, slots=True)
class LeasedRead:
    """Source blocks leased for one read into local blocks, and how long the read may take."""
    src_ids: list[int]
    budget_seconds: float  # the lease's time left, capped by the caller's timeout
    lease_seconds: float
    started: float  # time.monotonic() before the lease call

    def check_outlasted(self, handle: KVHandle, what: str) -> None:
        """ValueError when the read finished past the lease (the source may reuse blocks)."""
        if time.monotonic() - self.started >= self.lease_seconds:
            raise ValueError(f"KV handle {handle.handle_id}: {what} outlasted the "
                             f"{self.lease_seconds:.0f} s lease; the blocks may have been reused")


async def lease_for_read(source: KVSource, handle: KVHandle, block_ids: list[int],
                         start_block: int, timeout: float | None) -> LeasedRead:
    """Renews the handle's pin and checks that the source leases as many blocks, from
    start_block on, as the receiver reads into; reads go only while the lease lasts."""
    started = time.monotonic()
    lease = await source.lease(handle.handle_id, start_block, timeout)
    src_ids = list(lease.block_ids)
    if len(src_ids) != len(block_ids):
        raise ValueError(f"KV handle {handle.handle_id}: source leased {len(src_ids)} "
                         f"blocks from block {start_block}, receiver expected "
                         f"{len(block_ids)}")
    budget = lease.lease_seconds - (time.monotonic() - started)
    if timeout is not None:
        budget = min(budget, timeout - (time.monotonic() - started))
    return LeasedRead(src_ids, budget, lease.lease_seconds, started)


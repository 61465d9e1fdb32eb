"""What the decode side's KV transfer needs of a source (prefill) worker, in Tandem's own types.

The worker's implementation is kv_transfer_service.KVPeerClient (the KVTransfer gRPC calls on
a channel to the source); the KV transfer code sees only this protocol, so it stays free of
gRPC stubs and protobuf.
"""
from __future__ import annotations

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

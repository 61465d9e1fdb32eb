"""The KVTransfer gRPC service, both ends, and the `grpc` KV transfer backend's data path.

Prefill side, `KVTransferServicer`: serves its pinned blocks over a gRPC stream (PullKV), the
control calls of the cuda-ipc backend (ExportKVCache, LeaseKV; see kv/cuda_ipc.py) and of the
nixl backend (ExportNixlAgent, LeaseKV; see kv/nixl_backend.py), and ReleaseKV. Decode side,
`KVPeerClient`: the same calls on a source worker, answered in Tandem's own types
(common/kv_exports.py), which is what the KV receiver (kv/receiver.py) talks to; `pull_kv`
pulls blocks over the stream into blocks the decode worker reserved.

Lease and release rules, whichever backend moves the bytes: a handle's blocks stay pinned on
the source until ReleaseKV or its lease ends; PullKV and LeaseKV renew the lease; a receiver
reads only while the lease lasts and releases after its blocks were written. This module and
the servicers are the only places KV transfer meets protobuf."""
from __future__ import annotations

import grpc

from tandem.common.convert import (connector_export_from_proto, connector_export_to_proto,
                                   cuda_ipc_export_from_proto, cuda_ipc_export_to_proto,
                                   kv_lease_from_proto, layout_from_proto, layout_to_proto,
                                   nixl_export_from_proto, nixl_export_to_proto)
from tandem.common.kv_exports import ConnectorExport, CudaIpcExport, KVLease, NixlAgentExport
from tandem.common.kv_layout import KVLayout, KVLayoutMismatch
from tandem.common.logging import get_logger
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.workers.async_engine import AsyncEngine
from tandem.workers.kv.block_access import KVBlockAccess
from tandem.workers.kv.block_payload import DEFAULT_CHUNK_BYTES, iter_payload_chunks

logger = get_logger(__name__)


class KVTransferServicer(worker_pb2_grpc.KVTransferServicer):
    """Serves pinned prompts' KV. Handle ids are the request ids the prefill pinned."""

    def __init__(self, engine: AsyncEngine, layout: KVLayout, blocks: KVBlockAccess,
                 exporter=None, nixl_agent=None, connectors: dict | None = None) -> None:
        self.engine = engine
        self.layout = layout
        self.blocks = blocks
        self.exporter = exporter  # a cuda_ipc.CudaIpcExporter when cuda-ipc is offered
        # a nixl_backend.NixlKVAgent (TP: a nixl_receiver.RankGroupNixl) when nixl is offered
        self.nixl_agent = nixl_agent
        self.connectors = connectors or {}  # name -> kv.connector.KVConnector offered

    async def _check_layout(self, request, context) -> None:
        """Refuses (FAILED_PRECONDITION) a receiver whose expected layout ours cannot fill."""
        try:
            self.layout.check_readable_by(layout_from_proto(request.expected_layout))
        except KVLayoutMismatch as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    async def PullKV(self, request, context):
        await self._check_layout(request, context)
        handle_id = request.handle_id
        # Renew the lease while the pull runs, and snapshot the block ids.
        block_ids = await self.engine.renew_kv_lease(handle_id)
        if block_ids is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"KV handle {handle_id!r} is unknown or its lease expired")
        if not 0 <= request.start_block <= len(block_ids):
            await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                f"start_block={request.start_block} outside [0, "
                                f"{len(block_ids)}]")
        kv_caches, payload_block_ids = await self.blocks.read(block_ids[request.start_block:])
        chunks = iter_payload_chunks(kv_caches, payload_block_ids)
        # Responses of up to DEFAULT_CHUNK_BYTES (or one larger chunk): under gRPC's 4 MB.
        response, size = worker_pb2.PullKVResponse(), 0
        for layer, kv_index, offset, data in chunks:
            if response.pieces and size + len(data) > DEFAULT_CHUNK_BYTES:
                yield response
                response, size = worker_pb2.PullKVResponse(), 0
            response.pieces.add(layer=layer, kv_index=kv_index, offset=offset, data=data)
            size += len(data)
        if response.pieces:
            yield response

    async def ExportKVCache(self, request, context):
        await self._check_layout(request, context)
        if self.exporter is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker does not offer cuda-ipc (--kv-transfer grpc or "
                                "nixl, or no CUDA device)")
        return cuda_ipc_export_to_proto(self.exporter.export())

    async def ExportNixlAgent(self, request, context):
        await self._check_layout(request, context)
        if self.nixl_agent is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker does not offer nixl (--kv-transfer grpc or "
                                "cuda-ipc, nixl not installed, or a CPU cache under auto)")
        return nixl_export_to_proto(self.nixl_agent.export())

    async def ExportConnector(self, request, context):
        await self._check_layout(request, context)
        connector = self.connectors.get(request.backend)
        if connector is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this worker does not offer {request.backend!r} (offered "
                                f"connectors: {sorted(self.connectors) or 'none'})")
        return connector_export_to_proto(connector.export())

    async def LeaseKV(self, request, context):
        block_ids = await self.engine.renew_kv_lease(request.handle_id)
        if block_ids is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"KV handle {request.handle_id!r} is unknown or its lease "
                                f"expired")
        if not 0 <= request.start_block <= len(block_ids):
            await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                f"start_block={request.start_block} outside [0, "
                                f"{len(block_ids)}]")
        return worker_pb2.LeaseKVResponse(
            block_ids=block_ids[request.start_block:],
            lease_seconds=self.engine.kv_lease_seconds)

    async def ReleaseKV(self, request, context):
        found = await self.engine.release_kv(request.handle_id)
        return worker_pb2.ReleaseKVResponse(found=found)


async def pull_kv(channel: grpc.aio.Channel, handle, local: KVLayout, blocks: KVBlockAccess,
                  block_ids: list[int], start_block: int, timeout: float | None) -> int:
    """Pull blocks [start_block, handle.num_blocks) of a handle (anything with a handle_id:
    the protobuf KVHandle or kv_exports.KVHandle) into block_ids (the receiver's blocks for
    those positions). Returns the bytes received. Raises grpc.aio.AioRpcError or ValueError
    (incomplete transfer)."""
    stub = worker_pb2_grpc.KVTransferStub(channel)
    writer = blocks.writer(block_ids)
    request = worker_pb2.PullKVRequest(handle_id=handle.handle_id, start_block=start_block,
                                       expected_layout=layout_to_proto(local))
    async for response in stub.PullKV(request, timeout=timeout):
        for piece in response.pieces:
            writer.write(piece.layer, piece.kv_index, piece.offset, piece.data)
    writer.check_complete()
    await blocks.commit(block_ids, writer)
    return writer.num_bytes


async def release_kv(channel: grpc.aio.Channel, handle_id: str, timeout: float = 5.0) -> bool:
    """Best effort: an unreleased handle is freed by its lease anyway."""
    try:
        response = await worker_pb2_grpc.KVTransferStub(channel).ReleaseKV(
            worker_pb2.ReleaseKVRequest(handle_id=handle_id), timeout=timeout)
        return response.found
    except grpc.aio.AioRpcError as exc:
        logger.warning("ReleaseKV %s failed: %s", handle_id, exc.code().name)
        return False


class KVPeerClient:
    """A source worker's KVTransfer service as the decode side's KV receiver calls it: the
    answers come back as Tandem's own types. `layout` is the receiver's, sent as the layout it
    expects (the source refuses FAILED_PRECONDITION when it cannot fill it)."""

    def __init__(self, channel: grpc.aio.Channel, layout: KVLayout) -> None:
        self.channel = channel
        self.layout = layout
        self._stub = worker_pb2_grpc.KVTransferStub(channel)

    async def export_cuda_ipc(self, timeout: float | None) -> CudaIpcExport:
        response = await self._stub.ExportKVCache(
            worker_pb2.ExportKVCacheRequest(expected_layout=layout_to_proto(self.layout)),
            timeout=timeout)
        return cuda_ipc_export_from_proto(response)

    async def export_nixl(self, timeout: float | None) -> NixlAgentExport:
        response = await self._stub.ExportNixlAgent(
            worker_pb2.ExportNixlAgentRequest(expected_layout=layout_to_proto(self.layout)),
            timeout=timeout)
        return nixl_export_from_proto(response)

    async def export_connector(self, backend: str, timeout: float | None) -> ConnectorExport:
        response = await self._stub.ExportConnector(
            worker_pb2.ExportConnectorRequest(backend=backend,
                                              expected_layout=layout_to_proto(self.layout)),
            timeout=timeout)
        return connector_export_from_proto(response)

    async def lease(self, handle_id: str, start_block: int, timeout: float | None) -> KVLease:
        response = await self._stub.LeaseKV(
            worker_pb2.LeaseKVRequest(handle_id=handle_id, start_block=start_block),
            timeout=timeout)
        return kv_lease_from_proto(response)

    async def pull_blocks(self, handle, blocks: KVBlockAccess, block_ids: list[int],
                          start_block: int, timeout: float | None) -> int:
        """The grpc backend: pull_kv on this channel."""
        return await pull_kv(self.channel, handle, self.layout, blocks, block_ids,
                             start_block, timeout)

"""KV handles and exports as Tandem's own types (common/kv_exports.py): what crosses the gRPC
edge (common/convert.py) and the TP control channel (to_bytes) comes back field for field."""
from __future__ import annotations

import pytest

from tandem.common import convert
from tandem.common.kv_exports import (CudaIpcCache, CudaIpcEndpoint, CudaIpcExport,
                                      CudaIpcTensor, NixlAgentExport, NixlEndpoint,
                                      TensorBlocks, cuda_ipc_cache_from_bytes,
                                      cuda_ipc_export_from_bytes, layout_from_bytes,
                                      nixl_export_from_bytes, to_bytes)
from tandem.common.kv_layout import KVLayout
from tandem.v1 import worker_pb2

LAYOUT = KVLayout("mla_indexer", 3, 16, 1, 576, "bfloat16", 0, 2, 128)


def cuda_ipc_export() -> CudaIpcExport:
    tensor = CudaIpcTensor(b"\x00handle\xff", 4096, 512, b"ref", 8, b"", True, (4, 16, 1, 576),
                           (9216, 576, 576, 1), 3)
    return CudaIpcExport(CudaIpcEndpoint("host/boot", "GPU-1", "e1"), LAYOUT,
                         (CudaIpcCache("GPU-1", (tensor, tensor)), CudaIpcCache("GPU-2", ())))


def nixl_export() -> NixlAgentExport:
    rank = NixlAgentExport(NixlEndpoint("agent-0", "x0"), LAYOUT, b"\x01meta\x00", "VRAM",
                           (TensorBlocks(2**40, 4096, 2048, 10, 1),))
    return NixlAgentExport(rank.endpoint, LAYOUT, rank.agent_metadata, rank.mem_type,
                           rank.tensors, ranks=(rank, rank))


def test_exports_survive_the_control_channel_bytes():
    export = cuda_ipc_export()
    assert cuda_ipc_export_from_bytes(to_bytes(export)) == export
    assert cuda_ipc_cache_from_bytes(to_bytes(export.ranks[0])) == export.ranks[0]
    assert nixl_export_from_bytes(to_bytes(nixl_export())) == nixl_export()
    assert layout_from_bytes(to_bytes(LAYOUT)) == LAYOUT


def test_exports_survive_the_grpc_edge():
    export = cuda_ipc_export()
    message = worker_pb2.ExportKVCacheResponse.FromString(
        convert.cuda_ipc_export_to_proto(export).SerializeToString())
    assert convert.cuda_ipc_export_from_proto(message) == export
    message = worker_pb2.ExportNixlAgentResponse.FromString(
        convert.nixl_export_to_proto(nixl_export()).SerializeToString())
    assert convert.nixl_export_from_proto(message) == nixl_export()


def test_a_handle_keeps_only_the_endpoints_it_carries():
    endpoint = CudaIpcEndpoint("host/boot", "GPU-1", "e1", (4, 5), 12.5)
    message = worker_pb2.KVHandle(handle_id="r", num_blocks=2, transports=["cuda-ipc", "grpc"],
                                  cuda_ipc=convert.cuda_ipc_endpoint_to_proto(endpoint))
    handle = convert.kv_handle_from_proto(message)
    assert (handle.handle_id, handle.num_blocks, handle.transports) == \
        ("r", 2, ("cuda-ipc", "grpc"))
    assert handle.cuda_ipc == endpoint and handle.nixl is None
    message = worker_pb2.KVHandle(handle_id="n", nixl=convert.nixl_endpoint_to_proto(
        NixlEndpoint("agent", "x")))
    handle = convert.kv_handle_from_proto(message)
    assert handle.nixl == NixlEndpoint("agent", "x") and handle.cuda_ipc is None


def test_bytes_that_are_no_export_are_refused():
    with pytest.raises(ValueError, match="not a cuda-ipc export"):
        cuda_ipc_export_from_bytes(to_bytes(LAYOUT))
    with pytest.raises(ValueError, match="not an export"):
        nixl_export_from_bytes(b"\xff")
    with pytest.raises(ValueError, match="not a KV layout"):
        layout_from_bytes(b'{"kind": "mha"}')

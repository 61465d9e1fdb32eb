"""Conversions between protobuf messages and Tandem's own types, in one place.

The engine never imports generated stubs; servicers call these at the edge.
"""
from __future__ import annotations

from tandem.common.kv_exports import (ConnectorEndpoint, ConnectorExport, CudaIpcCache,
                                      CudaIpcEndpoint, CudaIpcExport, CudaIpcTensor, KVHandle,
                                      KVLease, NixlAgentExport, NixlEndpoint, TensorBlocks)
from tandem.common.kv_layout import KVLayout
from tandem.common.sampling_params import SamplingParams
from tandem.common.structured_output import StructuredOutput
from tandem.v1 import generate_pb2, worker_pb2

_FINISH_TO_PROTO = {
    "stop": generate_pb2.FINISH_REASON_STOP,
    "length": generate_pb2.FINISH_REASON_LENGTH,
    "abort": generate_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}


def finish_reason_to_proto(reason: str | None) -> int:
    return _FINISH_TO_PROTO[reason] if reason else generate_pb2.FINISH_REASON_UNSPECIFIED


def finish_reason_from_proto(value: int) -> str | None:
    return _FINISH_FROM_PROTO.get(value)


def engine_params_to_proto(params: SamplingParams) -> worker_pb2.EngineParams:
    sampling = generate_pb2.SamplingParameters(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        min_p=params.min_p, repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty)
    if params.seed is not None:
        sampling.seed = params.seed
    message = worker_pb2.EngineParams(
        sampling=sampling, max_tokens=params.max_tokens, min_tokens=params.min_tokens,
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos)
    if params.logprobs is not None:
        message.logprobs = params.logprobs
    if params.structured_output is not None:
        message.structured_output.CopyFrom(structured_output_to_proto(params.structured_output))
    return message


def engine_params_from_proto(message: worker_pb2.EngineParams,
                             max_tokens: int | None = None) -> SamplingParams:
    """ValueError (naming the field) for values SamplingParams rejects."""
    s = message.sampling
    return SamplingParams(
        max_tokens=message.max_tokens if max_tokens is None else max_tokens,
        min_tokens=min(message.min_tokens,
                       message.max_tokens if max_tokens is None else max_tokens),
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
        repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed if s.HasField("seed") else None,
        stop_token_ids=tuple(message.stop_token_ids), ignore_eos=message.ignore_eos,
        logprobs=message.logprobs if message.HasField("logprobs") else None,
        structured_output=structured_output_from_proto(message.structured_output)
        if message.HasField("structured_output") else None)


def structured_output_to_proto(structured: StructuredOutput) -> generate_pb2.StructuredOutput:
    if structured.kind == "json_object":
        return generate_pb2.StructuredOutput(json_object=generate_pb2.JsonObject())
    if structured.kind == "choice":
        return generate_pb2.StructuredOutput(
            choice=generate_pb2.Choice(choices=list(structured.choices)))
    return generate_pb2.StructuredOutput(**{structured.kind: structured.spec})


def structured_output_from_proto(message: generate_pb2.StructuredOutput) -> StructuredOutput:
    """ValueError naming the field when no format is set or the spec is empty or too large."""
    kind = message.WhichOneof("format")
    if kind is None:
        raise ValueError("structured_output: one of json_schema, json_object, regex, grammar "
                         "or choice is required")
    if kind == "json_object":
        return StructuredOutput(kind)
    if kind == "choice":
        return StructuredOutput(kind, choices=tuple(message.choice.choices))
    return StructuredOutput(kind, getattr(message, kind))


def logprob_to_proto(logprob) -> generate_pb2.TokenLogprob:
    return generate_pb2.TokenLogprob(
        token_id=logprob.token_id, logprob=logprob.logprob, rank=logprob.rank,
        top=[generate_pb2.TopLogprob(token_id=t, logprob=v) for t, v in logprob.top_logprobs])


def layout_to_proto(layout: KVLayout) -> worker_pb2.KVLayout:
    return worker_pb2.KVLayout(**layout.as_dict())


def layout_from_proto(message: worker_pb2.KVLayout) -> KVLayout:
    return KVLayout(kind=message.kind, num_layers=message.num_layers,
                    block_size=message.block_size, num_kv_heads=message.num_kv_heads,
                    head_dim=message.head_dim, dtype=message.dtype, tp_rank=message.tp_rank,
                    tp_size=message.tp_size, index_head_dim=message.index_head_dim)


def cuda_ipc_endpoint_to_proto(endpoint: CudaIpcEndpoint) -> worker_pb2.CudaIpcEndpoint:
    return worker_pb2.CudaIpcEndpoint(
        host_id=endpoint.host_id, device_uuid=endpoint.device_uuid,
        export_id=endpoint.export_id, block_ids=list(endpoint.block_ids),
        lease_deadline_monotonic=endpoint.lease_deadline_monotonic)


def cuda_ipc_endpoint_from_proto(message: worker_pb2.CudaIpcEndpoint) -> CudaIpcEndpoint:
    return CudaIpcEndpoint(message.host_id, message.device_uuid, message.export_id,
                           tuple(message.block_ids), message.lease_deadline_monotonic)


def cuda_ipc_export_to_proto(export: CudaIpcExport) -> worker_pb2.ExportKVCacheResponse:
    return worker_pb2.ExportKVCacheResponse(
        endpoint=cuda_ipc_endpoint_to_proto(export.endpoint),
        layout=layout_to_proto(export.layout),
        ranks=[worker_pb2.CudaIpcCache(device_uuid=rank.device_uuid, tensors=[
            worker_pb2.CudaIpcTensor(
                storage_handle=t.storage_handle, storage_size_bytes=t.storage_size_bytes,
                storage_offset_bytes=t.storage_offset_bytes,
                ref_counter_handle=t.ref_counter_handle,
                ref_counter_offset=t.ref_counter_offset, event_handle=t.event_handle,
                event_sync_required=t.event_sync_required, shape=list(t.shape),
                stride=list(t.stride), storage_offset=t.storage_offset)
            for t in rank.tensors]) for rank in export.ranks])


def cuda_ipc_export_from_proto(message: worker_pb2.ExportKVCacheResponse) -> CudaIpcExport:
    return CudaIpcExport(
        endpoint=cuda_ipc_endpoint_from_proto(message.endpoint),
        layout=layout_from_proto(message.layout),
        ranks=tuple(CudaIpcCache(rank.device_uuid, tuple(
            CudaIpcTensor(t.storage_handle, t.storage_size_bytes, t.storage_offset_bytes,
                          t.ref_counter_handle, t.ref_counter_offset, t.event_handle,
                          t.event_sync_required, tuple(t.shape), tuple(t.stride),
                          t.storage_offset) for t in rank.tensors))
            for rank in message.ranks))


def nixl_endpoint_to_proto(endpoint: NixlEndpoint) -> worker_pb2.NixlEndpoint:
    return worker_pb2.NixlEndpoint(agent_name=endpoint.agent_name, export_id=endpoint.export_id)


def nixl_export_to_proto(export: NixlAgentExport) -> worker_pb2.ExportNixlAgentResponse:
    return worker_pb2.ExportNixlAgentResponse(
        endpoint=nixl_endpoint_to_proto(export.endpoint), layout=layout_to_proto(export.layout),
        agent_metadata=export.agent_metadata, mem_type=export.mem_type,
        tensors=[worker_pb2.NixlTensor(
            base_address=t.base_address, block_stride_bytes=t.block_stride_bytes,
            block_bytes=t.block_bytes, num_blocks=t.num_blocks, device_id=t.device_id)
            for t in export.tensors],
        ranks=[nixl_export_to_proto(rank) for rank in export.ranks])


def nixl_export_from_proto(message: worker_pb2.ExportNixlAgentResponse) -> NixlAgentExport:
    return NixlAgentExport(
        endpoint=NixlEndpoint(message.endpoint.agent_name, message.endpoint.export_id),
        layout=layout_from_proto(message.layout), agent_metadata=message.agent_metadata,
        mem_type=message.mem_type,
        tensors=tuple(TensorBlocks(t.base_address, t.block_stride_bytes, t.block_bytes,
                                   t.num_blocks, t.device_id) for t in message.tensors),
        ranks=tuple(nixl_export_from_proto(rank) for rank in message.ranks))


def kv_handle_from_proto(message: worker_pb2.KVHandle) -> KVHandle:
    """What the decode side's transfer needs of a handle (the servicer checks the rest)."""
    return KVHandle(
        handle_id=message.handle_id, num_blocks=message.num_blocks,
        transports=tuple(message.transports),
        cuda_ipc=(cuda_ipc_endpoint_from_proto(message.cuda_ipc)
                  if message.HasField("cuda_ipc") else None),
        nixl=(NixlEndpoint(message.nixl.agent_name, message.nixl.export_id)
              if message.HasField("nixl") else None),
        connectors={name: ConnectorEndpoint(e.export_id, e.descriptor)
                    for name, e in message.connectors.items()})


def connector_endpoint_to_proto(endpoint: ConnectorEndpoint) -> worker_pb2.ConnectorEndpoint:
    return worker_pb2.ConnectorEndpoint(export_id=endpoint.export_id,
                                        descriptor=endpoint.descriptor)


def connector_export_to_proto(export: ConnectorExport) -> worker_pb2.ExportConnectorResponse:
    return worker_pb2.ExportConnectorResponse(export_id=export.export_id,
                                              ranks=list(export.ranks))


def connector_export_from_proto(message: worker_pb2.ExportConnectorResponse
                                ) -> ConnectorExport:
    return ConnectorExport(message.export_id, tuple(message.ranks))


def kv_lease_from_proto(message: worker_pb2.LeaseKVResponse) -> KVLease:
    return KVLease(list(message.block_ids), message.lease_seconds)

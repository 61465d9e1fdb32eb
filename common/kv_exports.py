"""What KV transfer passes between workers, as Tandem's own types: handles and cache exports.

The KV transfer code (workers/kv/, workers/parallel/) works on these; the servicers convert
them to and from protobuf at the edge (common/convert.py). Inside one worker, rank 0 and its
follower ranks exchange exports and layouts as bytes (`to_bytes` / `*_from_bytes`: JSON, bytes
fields in base64), so the TP control channel carries no protobuf either.

    CudaIpcExport   a source's cache as CUDA IPC handles, one CudaIpcCache per TP rank
    NixlAgentExport a source's NIXL agent (metadata, memory type, where its blocks are); under
                    TP one per rank in `ranks`
    ConnectorExport a source's export of a connector backend (kv/connectors.py), every rank's
                    as that backend encodes it
    KVHandle        what a decode worker needs of a prefill's handle to pull it
    KVLease         a renewed pin: the source's block ids and how long they stay pinned
"""
from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass, field

from tandem.common.kv_layout import KVLayout


@dataclass(frozen=True, slots=True)
class CudaIpcEndpoint:
    """Where a cuda-ipc source is: its host (one boot), device and export (one per process).
    In a handle it also names the prompt's pinned blocks and their deadline on the source
    host's monotonic clock (empty / 0: the receiver leases them first)."""

    host_id: str
    device_uuid: str
    export_id: str
    block_ids: tuple[int, ...] = ()
    lease_deadline_monotonic: float = 0.0


@dataclass(frozen=True, slots=True)
class CudaIpcTensor:
    """One cache tensor shared through CUDA IPC (the fields of torch's `_share_cuda_()` plus
    the tensor's view of its storage)."""

    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


@dataclass(frozen=True, slots=True)
class CudaIpcCache:
    """One TP rank's cache tensors, layer-major (cuda_ipc.flat_caches)."""

    device_uuid: str
    tensors: tuple[CudaIpcTensor, ...]


@dataclass(frozen=True, slots=True)
class CudaIpcExport:
    """A source's whole cache: ranks[r] is TP rank r's share."""

    endpoint: CudaIpcEndpoint
    layout: KVLayout
    ranks: tuple[CudaIpcCache, ...]


@dataclass(frozen=True, slots=True)
class NixlEndpoint:
    agent_name: str
    export_id: str


@dataclass(frozen=True, slots=True)
class TensorBlocks:
    """Where one cache tensor's blocks are: block b is [base + b * stride, + block_bytes)."""

    base_address: int
    block_stride_bytes: int
    block_bytes: int
    num_blocks: int
    device_id: int


@dataclass(frozen=True, slots=True)
class NixlAgentExport:
    """A source's NIXL agent over its cache; a TP source's also lists every rank's agent in
    rank order in `ranks` (its own fields are rank 0's)."""

    endpoint: NixlEndpoint
    layout: KVLayout
    agent_metadata: bytes
    mem_type: str
    tensors: tuple[TensorBlocks, ...]
    ranks: tuple[NixlAgentExport, ...] = ()


@dataclass(frozen=True, slots=True)
class ConnectorEndpoint:
    """Where a connector backend's source is, as handles carry it: export_id changes whenever
    the source (re)registers its cache; descriptor is the backend's own (may be empty)."""

    export_id: str
    descriptor: bytes = b""


@dataclass(frozen=True, slots=True)
class ConnectorExport:
    """A source's export of a connector backend: ranks[r] is TP rank r's, opaque here."""

    export_id: str
    ranks: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class KVHandle:
    """A prefill worker's pinned prompt, as the decode side pulls it. transports: what the
    source offers, preferred first; cuda_ipc / nixl: set when it offers that backend;
    connectors: backend name -> endpoint, for the connector backends it offers."""

    handle_id: str
    num_blocks: int
    transports: tuple[str, ...] = ()
    cuda_ipc: CudaIpcEndpoint | None = None
    nixl: NixlEndpoint | None = None
    connectors: dict[str, ConnectorEndpoint] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class KVLease:
    block_ids: list[int] = field(default_factory=list)
    lease_seconds: float = 0.0


def to_bytes(value: CudaIpcExport | CudaIpcCache | NixlAgentExport | KVLayout) -> bytes:
    return json.dumps(_plain(value)).encode()


def layout_from_bytes(data: bytes) -> KVLayout:
    """The inverse of to_bytes; ValueError when the bytes are not one."""
    try:
        return KVLayout(**_loads(data))
    except TypeError as exc:
        raise ValueError(f"not a KV layout: {exc}") from exc


def cuda_ipc_cache_from_bytes(data: bytes) -> CudaIpcCache:
    """The inverse of to_bytes; ValueError when the bytes are not one."""
    try:
        return _cuda_ipc_cache(_loads(data))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a cuda-ipc rank cache: {exc}") from exc


def cuda_ipc_export_from_bytes(data: bytes) -> CudaIpcExport:
    """The inverse of to_bytes; ValueError when the bytes are not one."""
    fields = _loads(data)
    try:
        return CudaIpcExport(endpoint=CudaIpcEndpoint(**_tuples(fields["endpoint"])),
                             layout=KVLayout(**fields["layout"]),
                             ranks=tuple(_cuda_ipc_cache(rank) for rank in fields["ranks"]))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a cuda-ipc export: {exc}") from exc


def _cuda_ipc_cache(fields: dict) -> CudaIpcCache:
    return CudaIpcCache(fields["device_uuid"], tuple(
        CudaIpcTensor(**_tuples(_unbytes(t))) for t in fields["tensors"]))


def nixl_export_from_bytes(data: bytes) -> NixlAgentExport:
    """The inverse of to_bytes; ValueError when the bytes are not one."""
    try:
        return _nixl_export(_loads(data))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a NIXL agent export: {exc}") from exc


def _nixl_export(fields: dict) -> NixlAgentExport:
    fields = _unbytes(fields)
    return NixlAgentExport(
        endpoint=NixlEndpoint(**fields["endpoint"]), layout=KVLayout(**fields["layout"]),
        agent_metadata=fields["agent_metadata"], mem_type=fields["mem_type"],
        tensors=tuple(TensorBlocks(**t) for t in fields["tensors"]),
        ranks=tuple(_nixl_export(rank) for rank in fields["ranks"]))


_BYTES = "__b64__"  # a bytes value travels as {_BYTES: its base64}


def _plain(value):
    """Dataclasses, tuples and bytes -> JSON values."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return {_BYTES: base64.b64encode(value).decode()}
    return value


def _unbytes(fields: dict) -> dict:
    return {k: base64.b64decode(v[_BYTES]) if isinstance(v, dict) and _BYTES in v else v
            for k, v in fields.items()}


def _tuples(fields: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}


def _loads(data: bytes) -> dict:
    try:
        fields = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"not an export: {exc}") from exc
    if not isinstance(fields, dict):
        raise ValueError("not an export: expected a JSON object")
    return fields

from tandem.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineParams(_message.Message):
    __slots__ = ("sampling", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs", "structured_output")
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    sampling: _generate_pb2.SamplingParameters
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    structured_output: _generate_pb2.StructuredOutput
    def __init__(self, sampling: _Optional[_Union[_generate_pb2.SamplingParameters, _Mapping]] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[_generate_pb2.StructuredOutput, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "keep_kv")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    KEEP_KV_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: EngineParams
    keep_kv: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[EngineParams, _Mapping]] = ..., keep_kv: _Optional[bool] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("token_id", "logprob", "finish_reason", "kv_handle", "num_cached_tokens", "queue_seconds", "compute_seconds")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: _generate_pb2.TokenLogprob
    finish_reason: _generate_pb2.FinishReason
    kv_handle: KVHandle
    num_cached_tokens: int
    queue_seconds: float
    compute_seconds: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[_generate_pb2.TokenLogprob, _Mapping]] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., kv_handle: _Optional[_Union[KVHandle, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("handle_id", "backend", "source_address", "layout", "num_tokens", "num_blocks", "lease_expires_at", "transports", "cuda_ipc", "nixl", "connectors")
    class ConnectorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ConnectorEndpoint
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ConnectorEndpoint, _Mapping]] = ...) -> None: ...
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    CONNECTORS_FIELD_NUMBER: _ClassVar[int]
    handle_id: str
    backend: str
    source_address: str
    layout: KVLayout
    num_tokens: int
    num_blocks: int
    lease_expires_at: float
    transports: _containers.RepeatedScalarFieldContainer[str]
    cuda_ipc: CudaIpcEndpoint
    nixl: NixlEndpoint
    connectors: _containers.MessageMap[str, ConnectorEndpoint]
    def __init__(self, handle_id: _Optional[str] = ..., backend: _Optional[str] = ..., source_address: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., num_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., lease_expires_at: _Optional[float] = ..., transports: _Optional[_Iterable[str]] = ..., cuda_ipc: _Optional[_Union[CudaIpcEndpoint, _Mapping]] = ..., nixl: _Optional[_Union[NixlEndpoint, _Mapping]] = ..., connectors: _Optional[_Mapping[str, ConnectorEndpoint]] = ...) -> None: ...

class ConnectorEndpoint(_message.Message):
    __slots__ = ("export_id", "descriptor")
    EXPORT_ID_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    export_id: str
    descriptor: bytes
    def __init__(self, export_id: _Optional[str] = ..., descriptor: _Optional[bytes] = ...) -> None: ...

class NixlEndpoint(_message.Message):
    __slots__ = ("agent_name", "export_id")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    EXPORT_ID_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    export_id: str
    def __init__(self, agent_name: _Optional[str] = ..., export_id: _Optional[str] = ...) -> None: ...

class CudaIpcEndpoint(_message.Message):
    __slots__ = ("host_id", "device_uuid", "export_id", "block_ids", "lease_deadline_monotonic")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    EXPORT_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_MONOTONIC_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    device_uuid: str
    export_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_deadline_monotonic: float
    def __init__(self, host_id: _Optional[str] = ..., device_uuid: _Optional[str] = ..., export_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., lease_deadline_monotonic: _Optional[float] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("kind", "num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "tp_rank", "tp_size", "index_head_dim")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    INDEX_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    kind: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tp_rank: int
    tp_size: int
    index_head_dim: int
    def __init__(self, kind: _Optional[str] = ..., num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., index_head_dim: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "generated_token_ids", "params", "kv_handle")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: EngineParams
    kv_handle: KVHandle
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[EngineParams, _Mapping]] = ..., kv_handle: _Optional[_Union[KVHandle, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "num_cached_tokens", "kv_pull_seconds")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    finish_reason: _generate_pb2.FinishReason
    num_cached_tokens: int
    kv_pull_seconds: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., num_cached_tokens: _Optional[int] = ..., kv_pull_seconds: _Optional[float] = ...) -> None: ...

class DecodeStreamRequest(_message.Message):
    __slots__ = ("start", "timeout_seconds")
    START_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    start: DecodeRequest
    timeout_seconds: float
    def __init__(self, start: _Optional[_Union[DecodeRequest, _Mapping]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class DecodeStreamResponse(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[DecodeUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[DecodeUpdate, _Mapping]]] = ...) -> None: ...

class DecodeUpdate(_message.Message):
    __slots__ = ("request_id", "response", "status_code", "status_message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: DecodeResponse
    status_code: int
    status_message: str
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[DecodeResponse, _Mapping]] = ..., status_code: _Optional[int] = ..., status_message: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("role", "num_running", "num_waiting", "kv_usage", "num_free_blocks", "num_pinned", "model", "instance_id", "held_request_ids")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    role: str
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_pinned: int
    model: str
    instance_id: str
    held_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, role: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., num_free_blocks: _Optional[int] = ..., num_pinned: _Optional[int] = ..., model: _Optional[str] = ..., instance_id: _Optional[str] = ..., held_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SubscribeKVEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubscribeKVEventsResponse(_message.Message):
    __slots__ = ("is_snapshot", "block_size", "stored_hashes", "evicted_hashes", "cleared")
    IS_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORED_HASHES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_HASHES_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    is_snapshot: bool
    block_size: int
    stored_hashes: _containers.RepeatedScalarFieldContainer[int]
    evicted_hashes: _containers.RepeatedScalarFieldContainer[int]
    cleared: bool
    def __init__(self, is_snapshot: _Optional[bool] = ..., block_size: _Optional[int] = ..., stored_hashes: _Optional[_Iterable[int]] = ..., evicted_hashes: _Optional[_Iterable[int]] = ..., cleared: _Optional[bool] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("num_forgotten_blocks",)
    NUM_FORGOTTEN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_forgotten_blocks: int
    def __init__(self, num_forgotten_blocks: _Optional[int] = ...) -> None: ...

class PullKVRequest(_message.Message):
    __slots__ = ("handle_id", "start_block", "expected_layout")
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    handle_id: str
    start_block: int
    expected_layout: KVLayout
    def __init__(self, handle_id: _Optional[str] = ..., start_block: _Optional[int] = ..., expected_layout: _Optional[_Union[KVLayout, _Mapping]] = ...) -> None: ...

class ExportKVCacheRequest(_message.Message):
    __slots__ = ("expected_layout",)
    EXPECTED_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    expected_layout: KVLayout
    def __init__(self, expected_layout: _Optional[_Union[KVLayout, _Mapping]] = ...) -> None: ...

class ExportKVCacheResponse(_message.Message):
    __slots__ = ("endpoint", "layout", "ranks")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    endpoint: CudaIpcEndpoint
    layout: KVLayout
    ranks: _containers.RepeatedCompositeFieldContainer[CudaIpcCache]
    def __init__(self, endpoint: _Optional[_Union[CudaIpcEndpoint, _Mapping]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[CudaIpcCache, _Mapping]]] = ...) -> None: ...

class CudaIpcCache(_message.Message):
    __slots__ = ("device_uuid", "tensors")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    tensors: _containers.RepeatedCompositeFieldContainer[CudaIpcTensor]
    def __init__(self, device_uuid: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[CudaIpcTensor, _Mapping]]] = ...) -> None: ...

class CudaIpcTensor(_message.Message):
    __slots__ = ("storage_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "shape", "stride", "storage_offset")
    STORAGE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    storage_offset: int
    def __init__(self, storage_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., storage_offset: _Optional[int] = ...) -> None: ...

class LeaseKVRequest(_message.Message):
    __slots__ = ("handle_id", "start_block")
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    handle_id: str
    start_block: int
    def __init__(self, handle_id: _Optional[str] = ..., start_block: _Optional[int] = ...) -> None: ...

class LeaseKVResponse(_message.Message):
    __slots__ = ("block_ids", "lease_seconds")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_seconds: float
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class PullKVResponse(_message.Message):
    __slots__ = ("pieces",)
    PIECES_FIELD_NUMBER: _ClassVar[int]
    pieces: _containers.RepeatedCompositeFieldContainer[KVPiece]
    def __init__(self, pieces: _Optional[_Iterable[_Union[KVPiece, _Mapping]]] = ...) -> None: ...

class KVPiece(_message.Message):
    __slots__ = ("layer", "kv_index", "offset", "data")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KV_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    layer: int
    kv_index: int
    offset: int
    data: bytes
    def __init__(self, layer: _Optional[int] = ..., kv_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("handle_id",)
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    handle_id: str
    def __init__(self, handle_id: _Optional[str] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ExportNixlAgentRequest(_message.Message):
    __slots__ = ("expected_layout",)
    EXPECTED_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    expected_layout: KVLayout
    def __init__(self, expected_layout: _Optional[_Union[KVLayout, _Mapping]] = ...) -> None: ...

class ExportNixlAgentResponse(_message.Message):
    __slots__ = ("endpoint", "layout", "agent_metadata", "mem_type", "tensors", "ranks")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    endpoint: NixlEndpoint
    layout: KVLayout
    agent_metadata: bytes
    mem_type: str
    tensors: _containers.RepeatedCompositeFieldContainer[NixlTensor]
    ranks: _containers.RepeatedCompositeFieldContainer[ExportNixlAgentResponse]
    def __init__(self, endpoint: _Optional[_Union[NixlEndpoint, _Mapping]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., agent_metadata: _Optional[bytes] = ..., mem_type: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[NixlTensor, _Mapping]]] = ..., ranks: _Optional[_Iterable[_Union[ExportNixlAgentResponse, _Mapping]]] = ...) -> None: ...

class NixlTensor(_message.Message):
    __slots__ = ("base_address", "block_stride_bytes", "block_bytes", "num_blocks", "device_id")
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    base_address: int
    block_stride_bytes: int
    block_bytes: int
    num_blocks: int
    device_id: int
    def __init__(self, base_address: _Optional[int] = ..., block_stride_bytes: _Optional[int] = ..., block_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., device_id: _Optional[int] = ...) -> None: ...

class ExportConnectorRequest(_message.Message):
    __slots__ = ("backend", "expected_layout")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    backend: str
    expected_layout: KVLayout
    def __init__(self, backend: _Optional[str] = ..., expected_layout: _Optional[_Union[KVLayout, _Mapping]] = ...) -> None: ...

class ExportConnectorResponse(_message.Message):
    __slots__ = ("export_id", "ranks")
    EXPORT_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    export_id: str
    ranks: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, export_id: _Optional[str] = ..., ranks: _Optional[_Iterable[bytes]] = ...) -> None: ...

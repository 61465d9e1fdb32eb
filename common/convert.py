"""Conversions between protobuf messages and Tandem's own types, in one place.

The engine never imports generated stubs; servicers call these at the edge.
"""
from __future__ import annotations

from tandem.common.sampling_params import SamplingParams
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
        logprobs=message.logprobs if message.HasField("logprobs") else None)


def logprob_to_proto(logprob) -> generate_pb2.TokenLogprob:
    return generate_pb2.TokenLogprob(
        token_id=logprob.token_id, logprob=logprob.logprob, rank=logprob.rank,
        top=[generate_pb2.TopLogprob(token_id=t, logprob=v) for t, v in logprob.top_logprobs])


def layout_to_proto(layout) -> worker_pb2.KVLayout:
    return worker_pb2.KVLayout(**layout.as_dict())


def layout_from_proto(message: worker_pb2.KVLayout):
    from tandem.workers.kv.layout import KVLayout

    return KVLayout(kind=message.kind, num_layers=message.num_layers,
                    block_size=message.block_size, num_kv_heads=message.num_kv_heads,
                    head_dim=message.head_dim, dtype=message.dtype, tp_rank=message.tp_rank,
                    tp_size=message.tp_size, index_head_dim=message.index_head_dim)

"""A minimal blocking client for tests: one Generate call, chunks collected."""
from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field

import grpc
from prometheus_client.parser import text_string_to_metric_families

from tandem.common.security import INTERNAL_TOKEN_KEY
from tandem.v1 import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc


@dataclass
class Result:
    deltas: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    complete: generate_pb2.Complete | None = None

    @property
    def text(self) -> str:
        return "".join(self.deltas)


def request(prompt: str | list[int], max_tokens: int = 16, min_tokens: int | None = None,
            temperature: float = 0.0, seed: int | None = None,
            **fields) -> generate_pb2.GenerateRequest:
    message = generate_pb2.GenerateRequest(
        sampling=generate_pb2.SamplingParameters(temperature=temperature, seed=seed),
        stop=generate_pb2.StopConditions(
            max_tokens=max_tokens, min_tokens=max_tokens if min_tokens is None else min_tokens),
        **fields)
    if isinstance(prompt, str):
        message.text = prompt
    else:
        message.token_ids.ids.extend(prompt)
    return message


def generate(address: str, message: generate_pb2.GenerateRequest,
             timeout: float = 60, on_tokens=None) -> Result:
    """One Generate call, chunks collected; on_tokens(n), when given, runs each time the
    client holds n tokens in all."""
    result = Result()
    with grpc.insecure_channel(address) as channel:
        for response in generate_pb2_grpc.GenerateStub(channel).Generate(message,
                                                                          timeout=timeout):
            if response.HasField("chunk"):
                result.deltas.append(response.chunk.text)
                result.token_ids.extend(response.chunk.token_ids)
                if on_tokens is not None and response.chunk.token_ids:
                    on_tokens(len(result.token_ids))
            else:
                result.complete = response.complete
    return result


# The internal token of the stacks `processes.start_up` starts; workers started without one
# ignore it.
STACK_INTERNAL_TOKEN = "tandem-e2e-internal-token"


def worker_load(address: str, request_ids=()) -> worker_pb2.GetLoadResponse:
    """The worker's GetLoad answer (asking whether it holds `request_ids`)."""
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(
            worker_pb2.GetLoadRequest(request_ids=list(request_ids)), timeout=5,
            metadata=[(INTERNAL_TOKEN_KEY, STACK_INTERNAL_TOKEN)])


# Every RPC a worker serves, with a request message of its type.
WORKER_RPCS = [("Worker", "Prefill", worker_pb2.PrefillRequest),
               ("Worker", "Decode", worker_pb2.DecodeRequest),
               ("Worker", "DecodeStream", worker_pb2.DecodeStreamRequest),
               ("Worker", "Abort", worker_pb2.AbortRequest),
               ("Worker", "GetLoad", worker_pb2.GetLoadRequest),
               ("Worker", "SubscribeKVEvents", worker_pb2.SubscribeKVEventsRequest),
               ("Worker", "ResetPrefixCache", worker_pb2.ResetPrefixCacheRequest),
               ("KVTransfer", "PullKV", worker_pb2.PullKVRequest),
               ("KVTransfer", "ReleaseKV", worker_pb2.ReleaseKVRequest),
               ("KVTransfer", "ExportKVCache", worker_pb2.ExportKVCacheRequest),
               ("KVTransfer", "LeaseKV", worker_pb2.LeaseKVRequest),
               ("KVTransfer", "ExportNixlAgent", worker_pb2.ExportNixlAgentRequest)]


def call_worker_rpc(channel, service: str, method: str, request_type, metadata=()):
    """Run one worker RPC to its end (a stream is drained); raises grpc.RpcError."""
    stub = getattr(worker_pb2_grpc, f"{service}Stub")(channel)
    descriptor = worker_pb2.DESCRIPTOR.services_by_name[service].methods_by_name[method]
    message = iter([request_type()]) if descriptor.client_streaming else request_type()
    reply = getattr(stub, method)(message, metadata=metadata, timeout=10)
    if hasattr(reply, "__iter__") and not hasattr(reply, "ListFields"):
        return list(reply)
    return reply


def router_counter(metrics_address: str, name: str, **labels) -> float:
    """The sum of a counter's samples on a /metrics endpoint whose labels include `labels`."""
    return metric_sum(metrics_address, f"{name}_total", **labels)


def metric_sum(metrics_address: str, sample_name: str, **labels) -> float:
    """The sum of the samples named `sample_name` (a gauge, a histogram's `_count`, ...) on a
    /metrics endpoint whose labels include `labels`."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == sample_name and labels.items() <= sample.labels.items())

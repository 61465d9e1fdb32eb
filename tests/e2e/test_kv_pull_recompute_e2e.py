"""A decode worker whose KV pull fails computes the prompt itself (`--kv-pull-failure
recompute`, the default) and streams the tokens of an undisturbed run, ending idle; with
`--kv-pull-failure fail` the call ends UNAVAILABLE as before."""
from __future__ import annotations

import urllib.request

import grpc
import pytest
from helpers.client import worker_load
from helpers.processes import free_port, start, stop, wait_serving
from prometheus_client.parser import text_string_to_metric_families

from tandem import SamplingParams
from tandem.common.convert import engine_params_to_proto
from tandem.v1 import worker_pb2, worker_pb2_grpc

PROMPT = [1, *range(300, 340)]
NUM_TOKENS = 12


def start_worker(model, log_dir, role: str, extra: list[str] = ()):
    port, metrics_port = free_port(), free_port()
    worker = start(f"{role}-{port}", ["tandem.workers.server", "--role", role, "--model",
                                      str(model), "--port", str(port), "--dtype", "float32",
                                      "--metrics-port", str(metrics_port),
                                      "--metrics-host", "127.0.0.1", *extra], port, log_dir)
    worker.metrics_address = f"127.0.0.1:{metrics_port}"
    return worker


@pytest.fixture(scope="module")
def workers(checkpoint, tmp_path_factory):
    """A prefill worker, a decode worker with the default policy and one with `fail`."""
    model = checkpoint("llama").path
    log_dir = tmp_path_factory.mktemp("recompute_logs")
    started = {"prefill": start_worker(model, log_dir, "prefill"),
               "recompute": start_worker(model, log_dir, "decode"),
               "fail": start_worker(model, log_dir, "decode", ["--kv-pull-failure", "fail"])}
    try:
        wait_serving(list(started.values()))
        yield started
    finally:
        stop(list(started.values()))


def params(seed: int | None) -> worker_pb2.SamplingParams:
    if seed is None:
        return engine_params_to_proto(SamplingParams(temperature=0, max_tokens=NUM_TOKENS,
                                                     ignore_eos=True))
    return engine_params_to_proto(SamplingParams(temperature=0.9, seed=seed,
                                                 max_tokens=NUM_TOKENS, ignore_eos=True))


def prefill(address: str, request_id: str, seed: int | None) -> worker_pb2.PrefillResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Prefill(worker_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=PROMPT, params=params(seed),
            keep_kv=True), timeout=60)


def decode(address: str, request_id: str, first: worker_pb2.PrefillResponse,
           seed: int | None, kv_handle: worker_pb2.KVHandle | None = None) -> list[int]:
    """The whole stream: the prefill's first token, then every decoded one."""
    message = worker_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=PROMPT,
                                       generated_token_ids=[first.token_id],
                                       params=params(seed))
    message.kv_handle.CopyFrom(kv_handle or first.kv_handle)
    tokens = [first.token_id]
    with grpc.insecure_channel(address) as channel:
        for response in worker_pb2_grpc.WorkerStub(channel).Decode(message, timeout=120):
            tokens.extend(response.token_ids)
    return tokens


def handle_at_closed_port(handle: worker_pb2.KVHandle) -> worker_pb2.KVHandle:
    """The same handle, its source a port nothing listens on (a prefill worker that died)."""
    dead = worker_pb2.KVHandle()
    dead.CopyFrom(handle)
    dead.source_address = f"127.0.0.1:{free_port()}"
    return dead


def recomputes(metrics_address: str) -> float:
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name == "tandem:kv_pull_recomputes"
               for sample in family.samples if sample.name.endswith("_total"))


def assert_idle(address: str) -> None:
    load = worker_load(address)
    assert (load.num_running, load.num_waiting, load.kv_usage) == (0, 0, 0)


def release(address: str, handle_id: str) -> None:
    with grpc.insecure_channel(address) as channel:
        worker_pb2_grpc.KVTransferStub(channel).ReleaseKV(
            worker_pb2.ReleaseKVRequest(handle_id=handle_id), timeout=5)


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_a_pull_from_a_dead_source_recomputes_the_prompt_with_identical_tokens(workers, seed):
    prefill_address = workers["prefill"].address
    decode_worker = workers["recompute"]
    undisturbed = decode(decode_worker.address, f"ok-{seed}",
                         prefill(prefill_address, f"ok-{seed}", seed), seed)
    assert len(undisturbed) == NUM_TOKENS
    before = recomputes(decode_worker.metrics_address)
    first = prefill(prefill_address, f"dead-{seed}", seed)
    dead = handle_at_closed_port(first.kv_handle)
    tokens = decode(decode_worker.address, f"dead-{seed}", first, seed, dead)
    release(prefill_address, f"dead-{seed}")
    assert tokens == undisturbed
    assert recomputes(decode_worker.metrics_address) == before + 1
    log = decode_worker.log_path.read_text()
    assert f"KV pull from {dead.source_address} failed" in log
    assert f"recomputing {len(PROMPT)} prompt tokens of dead-{seed}" in log
    assert_idle(decode_worker.address)


def test_a_released_handle_recomputes_the_prompt(workers):
    """The source answers NOT_FOUND (lease expired or released): recompute as well."""
    prefill_address = workers["prefill"].address
    decode_address = workers["recompute"].address
    first = prefill(prefill_address, "released", None)
    release(prefill_address, "released")
    tokens = decode(decode_address, "released", first, None)
    assert len(tokens) == NUM_TOKENS
    assert tokens == decode(decode_address, "again", prefill(prefill_address, "again", None),
                            None)
    assert_idle(decode_address)
    assert_idle(prefill_address)


def test_with_kv_pull_failure_fail_a_dead_source_ends_unavailable(workers):
    prefill_address = workers["prefill"].address
    decode_address = workers["fail"].address
    first = prefill(prefill_address, "dead-fail", None)
    dead = handle_at_closed_port(first.kv_handle)
    with pytest.raises(grpc.RpcError) as info:
        decode(decode_address, "dead-fail", first, None, dead)
    release(prefill_address, "dead-fail")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"KV pull from {dead.source_address} failed" in info.value.details()
    assert_idle(decode_address)

"""A decode worker whose KV pull fails computes the prompt itself (`--kv-pull-failure
recompute`, the default) and streams the tokens of an undisturbed run, ending idle; with
`--kv-pull-failure fail` the call ends UNAVAILABLE as before. Through the router, a prefill
worker killed between its answer and the pull costs the client nothing."""
from __future__ import annotations

import threading
import urllib.request

import grpc
import pytest
from helpers.client import generate, worker_load
from helpers.client import request as client_request
from helpers.hanging_kv_source import hanging_kv_source
from helpers.processes import free_port, start, start_stack, stop, wait_serving, wait_until
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



@pytest.mark.slow
def test_through_the_router_a_prefill_worker_killed_before_the_pull_costs_nothing(
        checkpoint, tmp_path):
    """1 prefill + 1 decode worker with 8 KV blocks. A pull from a hanging source holds 7 of
    them, so the routed request's decode waits for blocks after its Prefill answered; the
    prefill worker is SIGKILLed then, the hog is cancelled, and the decode worker's pull
    fails: it recomputes the prompt, and the client gets the undisturbed tokens with no
    migration."""
    stack = start_stack(checkpoint("llama").path, tmp_path, role_args={
        "decode": ["--num-kv-blocks", "8", "--max-model-len", "128"]})
    try:
        with hanging_kv_source() as hanging:
            prefill_worker, decode_worker = stack.workers["prefill-0"], stack.workers["decode-0"]
            message = client_request(PROMPT, max_tokens=60)
            undisturbed = generate(stack.router.address, message)
            hog_prompt = [2, *range(200, 299)]  # 100 tokens + its first token: 7 blocks
            hog_first = prefill_hog(prefill_worker.address, hog_prompt)
            release(prefill_worker.address, "hog")
            hog_handle = worker_pb2.KVHandle()
            hog_handle.CopyFrom(hog_first.kv_handle)
            hog_handle.source_address = hanging.address
            hog_message = worker_pb2.DecodeRequest(
                request_id="hog", prompt_token_ids=hog_prompt,
                generated_token_ids=[hog_first.token_id], params=params(None))
            hog_message.kv_handle.CopyFrom(hog_handle)
            with grpc.insecure_channel(decode_worker.address) as channel:
                hog = worker_pb2_grpc.WorkerStub(channel).Decode(hog_message, timeout=120)
                wait_until(lambda: worker_load(decode_worker.address).num_free_blocks <= 1, 30,
                           interval=0.02)
                outcome: dict = {}
                thread = threading.Thread(target=lambda: outcome.update(
                    result=generate(stack.router.address, message, timeout=120)), daemon=True)
                thread.start()
                wait_until(lambda: worker_load(prefill_worker.address).num_pinned == 1, 30,
                           interval=0.02)
                prefill_worker.popen.kill()
                prefill_worker.popen.wait(10)
                hog.cancel()
            hanging.release.set()
            thread.join(120)
            result = outcome.get("result")
            assert result is not None, f"router log:\n{stack.router.log_tail()}"
            assert result.token_ids == undisturbed.token_ids
            assert result.complete.usage.num_migrations == 0
            log = decode_worker.log_path.read_text()
            assert f"KV pull from {prefill_worker.address} failed" in log
            assert_idle(decode_worker.address)
    finally:
        stop(stack.processes)


def prefill_hog(address: str, prompt: list[int]) -> worker_pb2.PrefillResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Prefill(worker_pb2.PrefillRequest(
            request_id="hog", prompt_token_ids=prompt, params=params(None), keep_kv=True),
            timeout=60)

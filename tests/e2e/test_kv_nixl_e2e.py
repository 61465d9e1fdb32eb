"""router -> prefill -> decode with `--kv-transfer nixl` on CPU: the prompt's KV moves by NIXL
READs (UCX between two worker processes), the greedy tokens equal transformers', and with
`--kv-pull-failure fail` a pull that cannot complete (handle released, source gone) fails the
decode request with UNAVAILABLE naming the source, leaving no KV block behind on the decode
worker."""
from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest
from helpers.client import generate, request, worker_load
from helpers.processes import start_stack, stop

from tandem import SamplingParams
from tandem.common.convert import engine_params_to_proto
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.workers.kv.nixl_agent import is_installed

if not is_installed():
    pytest.skip("nixl is an optional extra (pip install 'tandem[nixl]')",
                allow_module_level=True)


@pytest.fixture(scope="module")
def nixl_stack(checkpoint, tmp_path_factory):
    stack = start_stack(checkpoint("llama").path, tmp_path_factory.mktemp("nixl_logs"),
                        worker_args=["--kv-transfer", "nixl", "--kv-lease-seconds", "5",
                                     "--kv-pull-failure", "fail"])
    yield stack
    stop(stack.processes)


def _prefill(address: str, request_id: str, prompt: list[int]) -> worker_pb2.PrefillResponse:
    params = engine_params_to_proto(SamplingParams(temperature=0, max_tokens=8))
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Prefill(worker_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, params=params, keep_kv=True),
            timeout=10)


def _decode(address: str, request_id: str, prompt: list[int],
            reply: worker_pb2.PrefillResponse) -> tuple[list[int], int]:
    """(every generated token, the first one being the prefill's; prompt tokens the decode
    worker found in its own prefix cache and so did not pull)."""
    params = engine_params_to_proto(SamplingParams(temperature=0, max_tokens=8))
    tokens, num_cached = [reply.token_id], None
    with grpc.insecure_channel(address) as channel:
        for response in worker_pb2_grpc.WorkerStub(channel).Decode(worker_pb2.DecodeRequest(
                request_id=request_id, prompt_token_ids=prompt,
                generated_token_ids=[reply.token_id], params=params,
                kv_handle=reply.kv_handle), timeout=20):
            if num_cached is None:
                num_cached = response.num_cached_tokens
            tokens.extend(response.token_ids)
    return tokens, num_cached


def _wait_idle(address: str, timeout: float = 5.0) -> worker_pb2.GetLoadResponse:
    deadline = time.monotonic() + timeout
    while True:
        load = worker_load(address)
        if load.kv_usage == 0 and load.num_running == 0 and load.num_pinned == 0:
            return load
        assert time.monotonic() < deadline, f"{address} still holds KV blocks: {load}"
        time.sleep(0.05)


def test_greedy_tokens_over_nixl_equal_transformers(nixl_stack, checkpoint):
    """Through the router, then a prompt sharing 48 tokens (3 blocks) straight to the
    workers: that pull skips the blocks the decode worker already caches (start_block 3).
    Every handle offers nixl, and nixl mode took it."""
    ckpt = checkpoint("llama")
    first = [(7 * i) % 380 + 1 for i in range(70)]
    result = generate(nixl_stack.router.address, request(first, max_tokens=12))
    assert result.token_ids == ckpt.greedy(first, 12)
    second = first[:48] + [3, 9, 27, 81, 243, 11, 33, 99, 297, 5]
    reply = _prefill(nixl_stack.workers["prefill-0"].address, "shares-a-prefix", second)
    tokens, num_cached = _decode(nixl_stack.workers["decode-0"].address, "shares-a-prefix",
                                 second, reply)
    assert num_cached == 48
    assert len(tokens) == 8 and tokens == ckpt.greedy(second, 8)
    log = nixl_stack.workers["decode-0"].log_path.read_text()
    assert "over nixl: loaded agent tandem-" in log
    assert "over grpc" not in log
    prefill_log = nixl_stack.workers["prefill-0"].log_path.read_text()
    assert "offering nixl, grpc" in prefill_log
    for worker in nixl_stack.workers.values():
        _wait_idle(worker.address)


def test_a_released_handle_fails_the_decode_unavailable_without_leaking(nixl_stack):
    prefill = nixl_stack.workers["prefill-0"].address
    decode = nixl_stack.workers["decode-0"].address
    free_before = _wait_idle(decode).num_free_blocks
    prompt = list(range(100, 160))
    reply = _prefill(prefill, "released-early", prompt)
    assert list(reply.kv_handle.transports) == ["nixl", "grpc"]
    assert reply.kv_handle.nixl.agent_name.startswith("tandem-")
    with grpc.insecure_channel(prefill) as channel:
        assert worker_pb2_grpc.KVTransferStub(channel).ReleaseKV(
            worker_pb2.ReleaseKVRequest(handle_id="released-early"), timeout=5).found
    with pytest.raises(grpc.RpcError) as info:
        _decode(decode, "released-early", prompt, reply)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"KV pull from {prefill} failed" in info.value.details()
    assert "'released-early' is unknown or its lease expired" in info.value.details()
    assert _wait_idle(decode).num_free_blocks == free_before


def test_a_vanished_prefill_worker_fails_the_decode_unavailable_without_leaking(nixl_stack):
    """Runs last: it kills the stack's prefill worker after its prompt was pinned."""
    prefill = nixl_stack.workers["prefill-0"]
    decode = nixl_stack.workers["decode-0"].address
    free_before = _wait_idle(decode).num_free_blocks
    prompt = list(range(200, 250))
    reply = _prefill(prefill.address, "orphaned", prompt)
    prefill.popen.kill()
    prefill.popen.wait(10)
    with pytest.raises(grpc.RpcError) as info:
        _decode(decode, "orphaned", prompt, reply)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"KV pull from {prefill.address} failed" in info.value.details()
    assert _wait_idle(decode).num_free_blocks == free_before


def test_tp2_workers_hand_kv_off_rank_to_rank_over_nixl(checkpoint, tmp_path):
    """TP=2 prefill -> TP=2 decode with --kv-transfer nixl: every rank has its own agent and
    READs its KV head from the source's rank of the same number (workers/kv/nixl_ranks.py); the
    tokens equal transformers', also for a stream decoding on the same worker while the
    handoffs' READs are posted and polled between its steps, and both workers end with no KV
    block in use."""
    ckpt = checkpoint("llama")  # 2 KV heads: one per rank
    stack = start_stack(ckpt.path, tmp_path, worker_args=[
        "--kv-transfer", "nixl", "--tensor-parallel-size", "2", "--kv-lease-seconds", "5"])
    try:
        beside = list(range(3, 20))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            background = pool.submit(generate, stack.router.address,
                                     request(beside, max_tokens=60))
            for prompt in ([(5 * i) % 300 + 2 for i in range(70)], list(range(40, 57))):
                result = generate(stack.router.address, request(prompt, max_tokens=12))
                assert result.token_ids == ckpt.greedy(prompt, 12)
            assert background.result(timeout=120).token_ids == ckpt.greedy(beside, 60)
        for worker in stack.workers.values():
            _wait_idle(worker.address)
        log = stack.workers["decode-0"].log_path.read_text()
        assert "over nixl: loaded agent tandem-" in log and "on all 2 ranks" in log
        assert "over grpc" not in log
        assert "offering nixl, grpc" in stack.workers["prefill-0"].log_path.read_text()
    finally:
        stop(stack.processes)

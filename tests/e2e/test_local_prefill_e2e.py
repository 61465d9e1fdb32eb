"""A split stack under cache-aware routing: local prefill on the decode worker that holds a
conversation, and another decode worker for a prefilled request the first one refuses.

One module-scoped stack: 1 prefill worker (4 s KV lease) and 2 decode workers, block size 4;
decode-1 has a small cache (32 blocks) and waits at most 6 s for free blocks. The router
prefills locally when a decode worker would leave at most 16 prompt tokens to compute; a
second router sends to prefill-0 and decode-1 only. The refusal test runs last (it fills half
of decode-1's cache while it runs).
"""
from __future__ import annotations

import random
import time

import grpc
import pytest
from helpers.client import generate, request, router_counter, worker_load
from helpers.hanging_kv_source import hanging_kv_source
from helpers.processes import (free_port, start, start_metered_stack, stop, wait_in_pool,
                               wait_serving, wait_until)

from tandem.common.convert import engine_params_to_proto
from tandem.common.sampling_params import SamplingParams
from tandem.v1 import worker_pb2, worker_pb2_grpc

BLOCK_SIZE = 4
LOCAL_PREFILL_MAX_TOKENS = 16
SMALL_CACHE_BLOCKS = 32
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(checkpoint, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("local_prefill_logs")
    stack = start_metered_stack(
        checkpoint, log_dir, num_prefill=1,
        num_decode=2, worker_args=["--block-size", str(BLOCK_SIZE)],
        role_args={"prefill": ["--kv-lease-seconds", "4"]},
        named_args={"decode-1": ["--num-kv-blocks", str(SMALL_CACHE_BLOCKS),
                                 "--max-model-len", str(SMALL_CACHE_BLOCKS * BLOCK_SIZE),
                                 "--max-block-wait-seconds", "6"]},
        router_args=["--local-prefill-max-tokens", str(LOCAL_PREFILL_MAX_TOKENS)])
    stack.router.metrics = stack.router_metrics
    port = free_port()
    small_only = start("router-small-only", [
        "tandem.router.server", "--model", str(checkpoint("llama").path), "--port", str(port),
        "--health-check-interval", "0.5", "--prefill", stack.workers["prefill-0"].address,
        "--decode", stack.workers["decode-1"].address], port, log_dir)
    stack.small_only_router = small_only
    try:
        wait_serving([small_only])
        wait_in_pool(small_only, [stack.workers["prefill-0"], stack.workers["decode-1"]])
        yield stack
    finally:
        stop([small_only, *stack.processes])


def prompt_of(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(3, 380) for _ in range(num_tokens)]


def params(max_tokens: int) -> worker_pb2.EngineParams:
    return engine_params_to_proto(SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                 min_tokens=max_tokens))


def counts(stack) -> dict[str, float]:
    """Router counters the tests compare before and after a request."""
    metrics = stack.router.metrics
    result = {"local_prefill": router_counter(metrics, "tandem:routing_reasons",
                                              reason="local_prefill", role="decode")}
    for role in ("prefill", "decode"):
        result[role] = router_counter(metrics, "tandem:routing_decisions", role=role)
    for name in ("decode-0", "decode-1"):
        result[name] = router_counter(metrics, "tandem:routing_decisions",
                                      worker=stack.workers[name].address)
    return result


def changes(stack, before: dict[str, float]) -> dict[str, float]:
    return {name: value - before[name] for name, value in counts(stack).items()}


def disaggregated_tokens(stack, decode_name: str, prompt: list[int], max_tokens: int,
                         request_id: str) -> list[int]:
    """The request's greedy tokens through the prefill -> decode handoff, called on the
    workers directly: Prefill (KV pinned), then a Decode that pulls it."""
    with grpc.insecure_channel(stack.workers["prefill-0"].address) as channel:
        first = worker_pb2_grpc.WorkerStub(channel).Prefill(worker_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, params=params(max_tokens),
            keep_kv=True), timeout=60)
    message = worker_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt,
                                       generated_token_ids=[first.token_id],
                                       params=params(max_tokens))
    message.kv_handle.CopyFrom(first.kv_handle)
    with grpc.insecure_channel(stack.workers[decode_name].address) as channel:
        replies = list(worker_pb2_grpc.WorkerStub(channel).Decode(message, timeout=60))
    return [first.token_id] + [t for reply in replies for t in reply.token_ids]


def test_a_next_turn_is_prefilled_on_the_decode_worker_holding_the_history(stack):
    rng = random.Random(11)
    turn = prompt_of(rng, 40)
    before = counts(stack)
    first = generate(stack.router.address, request(turn, max_tokens=8))
    routed = changes(stack, before)
    assert routed["prefill"] == 1 and routed["local_prefill"] == 0  # nobody held it
    (home,) = [name for name in ("decode-0", "decode-1") if routed[name] == 1]
    # The decode worker computed the reply: it holds the history's full blocks, the prefill
    # worker only the first turn's. 6 new tokens leave 10 of 54 to compute there.
    history = turn + first.token_ids + prompt_of(rng, 6)
    num_held = (len(turn) + len(first.token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    before = counts(stack)
    second = generate(stack.router.address, request(history, max_tokens=8))
    routed = changes(stack, before)
    assert routed == {**{name: 0 for name in routed}, "local_prefill": 1, "decode": 1,
                      home: 1}, routed
    assert second.complete.usage.cached_prompt_tokens == num_held
    assert worker_load(stack.workers["prefill-0"].address).num_pinned == 0
    assert second.token_ids == disaggregated_tokens(stack, home, history, 8, "reference-1")


def test_a_turn_with_more_new_tokens_than_the_limit_goes_to_the_prefill_tier(stack):
    rng = random.Random(12)
    turn = prompt_of(rng, 40)
    first = generate(stack.router.address, request(turn, max_tokens=8))
    history = turn + first.token_ids + prompt_of(rng, 30)  # 34 tokens left to compute
    before = counts(stack)
    second = generate(stack.router.address, request(history, max_tokens=8))
    routed = changes(stack, before)
    assert routed["local_prefill"] == 0 and routed["prefill"] == 1 and routed["decode"] == 1
    # The prefill worker holds the first turn's 10 blocks, not the reply's.
    assert second.complete.usage.cached_prompt_tokens == len(turn)
    assert len(second.token_ids) == 8



def test_a_decode_worker_without_free_blocks_refuses_and_another_serves(stack):
    """Half of decode-1's cache is held by a pull from a hanging source (usage 0.5 adds no
    load, so decode-1 ties with decode-0); a 70-token prompt needs 18 blocks, which decode-1
    does not have: it refuses after 6 s, longer than the prefill worker's 4 s lease, and
    decode-0 pulls the KV (still pinned: the waiting worker renewed the lease) and serves.
    Through the router that has decode-1 alone, the client gets RESOURCE_EXHAUSTED and the
    prefill worker's pin is released then (not left to its lease)."""
    prefill, small = stack.workers["prefill-0"], stack.workers["decode-1"]
    rng = random.Random(13)
    hog_prompt = prompt_of(rng, SMALL_CACHE_BLOCKS // 2 * BLOCK_SIZE - 1)  # + 1 token: half
    with hanging_kv_source() as hanging:
        with grpc.insecure_channel(prefill.address) as channel:
            hog_first = worker_pb2_grpc.WorkerStub(channel).Prefill(worker_pb2.PrefillRequest(
                request_id="hog", prompt_token_ids=hog_prompt, params=params(4),
                keep_kv=True), timeout=60)
            worker_pb2_grpc.KVTransferStub(channel).ReleaseKV(
                worker_pb2.ReleaseKVRequest(handle_id="hog"), timeout=10)
        hog_message = worker_pb2.DecodeRequest(
            request_id="hog", prompt_token_ids=hog_prompt,
            generated_token_ids=[hog_first.token_id], params=params(4))
        hog_message.kv_handle.CopyFrom(hog_first.kv_handle)
        hog_message.kv_handle.source_address = hanging.address
        with grpc.insecure_channel(small.address) as channel:
            hog = worker_pb2_grpc.WorkerStub(channel).Decode(hog_message, timeout=120)
            wait_until(lambda: worker_load(small.address).num_free_blocks
                       == SMALL_CACHE_BLOCKS // 2, 30)
            refusals = router_counter(stack.router.metrics, "tandem:decode_refusals",
                                      worker=small.address)
            # Ties alternate, so one of two requests tries decode-1 first. A load reading
            # taken just as the previous test's request ended can still count it on decode-1
            # until the next poll (every 0.5 s), so a few more tries follow a pause.
            for _ in range(5):
                result = generate(stack.router.address, request(prompt_of(rng, 70),
                                                                max_tokens=8), timeout=120)
                assert len(result.token_ids) == 8
                if router_counter(stack.router.metrics, "tandem:decode_refusals",
                                  worker=small.address) > refusals:
                    break
                time.sleep(0.6)
            assert router_counter(stack.router.metrics, "tandem:decode_refusals",
                                  worker=small.address) > refusals
            with pytest.raises(grpc.RpcError) as refused:
                generate(stack.small_only_router.address,
                         request(prompt_of(rng, 70), max_tokens=8, request_id="all-refused"),
                         timeout=120)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            hog.cancel()
        log = stack.workers["decode-0"].log_path.read_text()
        assert "KV pull from" not in log, log[-3000:]  # no pull found the lease expired
        wait_until(lambda: worker_load(prefill.address).num_pinned == 0, 30)
        assert "nobody pulled: all-refused" not in prefill.log_path.read_text()
        wait_until(lambda: worker_load(small.address).num_free_blocks == SMALL_CACHE_BLOCKS,
                   30)

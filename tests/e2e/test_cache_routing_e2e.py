"""Cache-aware routing end to end: workers publish their prefix-cache blocks (SubscribeKVEvents),
two routers index them and send each conversation where its prefix is.

One module-scoped stack: 3 aggregated workers (block size 4, a small cache) behind router A,
and router B on the same workers. The worker-kill test runs last (it takes a worker away).
"""
from __future__ import annotations

import random
import urllib.request

import grpc
import pytest
from helpers.client import generate, request, router_counter
from helpers.processes import free_port, start, start_metered_stack, stop, wait_serving, \
    wait_until
from prometheus_client.parser import text_string_to_metric_families

from tandem.common.block_hash import prefix_block_hashes
from tandem.v1 import generate_pb2_grpc, worker_pb2, worker_pb2_grpc

BLOCK_SIZE = 4
NUM_KV_BLOCKS = 96  # 384 tokens: a few long prompts evict the blocks of earlier ones
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def routers(checkpoint, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("cache_routing_logs")
    stack = start_metered_stack(
        checkpoint, log_dir, num_prefill=0, num_decode=0, num_both=3,
        worker_args=["--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_KV_BLOCKS),
                     "--max-model-len", "256"])
    port, metrics_port = free_port(), free_port()
    router_b = start("router-b", ["tandem.router.server", "--model",
                                  str(checkpoint("llama").path), "--port", str(port),
                                  "--health-check-interval", "0.5", "--metrics-port",
                                  str(metrics_port), "--both",
                                  ",".join(w.address for w in stack.workers.values())],
                     port, log_dir)
    router_b.metrics = f"127.0.0.1:{metrics_port}"
    stack.router.metrics = stack.router_metrics
    try:
        wait_serving([router_b])
        yield stack, stack.router, router_b
    finally:
        stop([router_b, *stack.processes])


def gauge(metrics_address: str, name: str, **labels) -> float:
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def decisions(router, workers) -> dict[str, float]:
    return {w.address: router_counter(router.metrics, "tandem:routing_decisions",
                                      worker=w.address) for w in workers}


def routed_to(router, workers, before: dict[str, float]) -> list[str]:
    after = decisions(router, workers)
    return [address for address in after if after[address] > before[address]]


def prompt_of(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(3, 380) for _ in range(num_tokens)]


def test_worker_streams_a_snapshot_then_stored_and_evicted_blocks(routers):
    stack, _, _ = routers
    worker = stack.workers["both-0"]
    rng = random.Random(1)
    prompt = prompt_of(rng, 41)  # 10 full blocks to look up
    hashes = prefix_block_hashes(prompt, BLOCK_SIZE)
    with grpc.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        events = stub.SubscribeKVEvents(worker_pb2.SubscribeKVEventsRequest(), timeout=120)
        snapshot = next(events)
        assert snapshot.is_snapshot and snapshot.block_size == BLOCK_SIZE
        assert not set(hashes) & set(snapshot.stored_hashes)
        held = set(snapshot.stored_hashes)

        def decode(token_ids):
            list(stub.Decode(worker_pb2.DecodeRequest(
                request_id=f"kv-events-{rng.random()}", prompt_token_ids=token_ids,
                params=_params(2)), timeout=60))

        decode(prompt)
        while not set(hashes) <= held:
            message = next(events)
            assert not message.is_snapshot
            held |= set(message.stored_hashes)
            held -= set(message.evicted_hashes)
        for _ in range(4):  # 4 x 100 tokens reuse every block of the small cache
            decode(prompt_of(rng, 100))
        while set(hashes) & held:
            message = next(events)
            held |= set(message.stored_hashes)
            held -= set(message.evicted_hashes)
        events.cancel()


def _params(max_tokens: int) -> worker_pb2.EngineParams:
    from tandem.common.convert import engine_params_to_proto
    from tandem.common.sampling_params import SamplingParams

    return engine_params_to_proto(SamplingParams(temperature=0.0, max_tokens=max_tokens))


def test_two_routers_send_a_conversation_to_the_same_worker(routers):
    stack, router_a, router_b = routers
    workers = list(stack.workers.values())
    rng = random.Random(2)
    for conversation in range(3):
        turn = prompt_of(rng, 30)
        before = decisions(router_a, workers)
        first = generate(router_a.address, request(turn, max_tokens=4))
        (home,) = routed_to(router_a, workers, before)
        history = turn + first.token_ids + prompt_of(rng, 10)
        num_blocks = (len(turn) - 1) // BLOCK_SIZE
        wait_until(lambda: gauge(router_b.metrics, "tandem:kv_index_blocks", worker=home)
                   >= num_blocks, timeout=30)
        before = decisions(router_b, workers)
        second = generate(router_b.address, request(history, max_tokens=4))
        assert routed_to(router_b, workers, before) == [home], conversation
        assert second.complete.usage.cached_prompt_tokens >= num_blocks * BLOCK_SIZE


def test_uniform_random_prompts_spread_evenly(routers):
    stack, router_a, _ = routers
    workers = list(stack.workers.values())
    rng = random.Random(3)
    before = decisions(router_a, workers)
    # 30 long generations started together (the call returns at once), all routed within the
    # time the tiny model takes to finish one: each pick sees the others in flight, and how
    # fast the shared CPU runs each worker does not decide where requests go.
    with grpc.insecure_channel(router_a.address) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        calls = []
        try:
            for _ in range(30):
                calls.append(stub.Generate(request(prompt_of(rng, 24), max_tokens=200),
                                           timeout=120))
            wait_until(lambda: sum(decisions(router_a, workers).values())
                       >= sum(before.values()) + 30, timeout=60)
            after = decisions(router_a, workers)
        finally:
            for call in calls:
                call.cancel()
    counts = [after[a] - before[a] for a in after]
    assert sum(counts) == len(calls)
    assert max(counts) <= 1.5 * min(counts), counts


def _decode_directly(address: str, request_id: str, token_ids: list[int]) -> None:
    with grpc.insecure_channel(address) as channel:
        list(worker_pb2_grpc.WorkerStub(channel).Decode(worker_pb2.DecodeRequest(
            request_id=request_id, prompt_token_ids=token_ids, params=_params(2)), timeout=60))


def test_a_prefix_cache_reset_clears_the_workers_blocks_from_every_index(routers):
    stack, router_a, router_b = routers
    worker = stack.workers["both-2"]
    rng = random.Random(5)
    prompt = prompt_of(rng, 33)
    hashes = set(prefix_block_hashes(prompt, BLOCK_SIZE, max_blocks=8))
    _decode_directly(worker.address, "before-reset", prompt)
    for router in (router_a, router_b):
        wait_until(lambda: gauge(router.metrics, "tandem:kv_index_blocks",
                                 worker=worker.address) >= 8, timeout=30)
    with grpc.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        events = stub.SubscribeKVEvents(worker_pb2.SubscribeKVEventsRequest(), timeout=60)
        assert hashes <= set(next(events).stored_hashes)
        reply = stub.ResetPrefixCache(worker_pb2.ResetPrefixCacheRequest(), timeout=30)
        assert reply.num_forgotten_blocks >= 8
        message = next(events)
        assert message.cleared and not hashes & set(message.stored_hashes)
        events.cancel()
    for router in (router_a, router_b):
        wait_until(lambda: gauge(router.metrics, "tandem:kv_index_blocks",
                                 worker=worker.address) == 0, timeout=30)
    with grpc.insecure_channel(worker.address) as channel:
        replies = list(worker_pb2_grpc.WorkerStub(channel).Decode(worker_pb2.DecodeRequest(
            request_id="after-reset", prompt_token_ids=prompt, params=_params(2)), timeout=60))
    assert replies[0].num_cached_tokens == 0  # nothing reusable is left
    for router in (router_a, router_b):  # the same subscription goes on after a clear
        wait_until(lambda: gauge(router.metrics, "tandem:kv_index_blocks",
                                 worker=worker.address) >= 8, timeout=30)


def test_a_killed_worker_leaves_every_index_and_its_restart_refills_them(routers):
    stack, router_a, router_b = routers
    victim = stack.workers["both-1"]
    rng = random.Random(4)
    _decode_directly(victim.address, "before-kill", prompt_of(rng, 33))
    for router in (router_a, router_b):
        wait_until(lambda: gauge(router.metrics, "tandem:kv_index_blocks",
                                 worker=victim.address) >= 8, timeout=30)
    victim.popen.kill()
    victim.popen.wait()
    for router in (router_a, router_b):
        wait_until(lambda: gauge(router.metrics, "tandem:kv_index_blocks",
                                 worker=victim.address) == 0, timeout=30)
    port = int(victim.address.rpartition(":")[2])
    restarted = start("both-1-restarted", victim.popen.args[2:], port, victim.log_path.parent)
    stack.workers["both-1"] = restarted  # the fixture stops it
    wait_serving([restarted])
    _decode_directly(restarted.address, "after-restart", prompt_of(rng, 33))
    for router in (router_a, router_b):  # resubscribed: a fresh snapshot, then its blocks
        wait_until(lambda: gauge(router.metrics, "tandem:kv_index_blocks",
                                 worker=restarted.address) >= 8, timeout=60)

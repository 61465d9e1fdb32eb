"""Workers with asynchronous scheduling forced on (on CPU it is off by default, as it gains
nothing there) serve exactly what the one-step-at-a-time offline engine gives: through the
split (prefill -> KV pull -> decode) and an aggregated worker, greedy and seeded sampled
streams side by side, stop strings; a cancelled stream leaves no KV block behind."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from helpers.checkpoints import random_prompts
from helpers.client import generate, request, worker_load
from helpers.processes import start_stack, stop, wait_until

from tandem import LLM, SamplingParams
from tandem.v1 import generate_pb2_grpc

pytestmark = pytest.mark.slow  # two stacks, ~45 s on a 2-core box
ASYNC = ["--async-scheduling"]


@pytest.fixture(scope="module")
def stacks(checkpoint, tmp_path_factory):
    path = checkpoint("llama").path
    split = start_stack(path, tmp_path_factory.mktemp("async_pd"), worker_args=ASYNC)
    try:
        both = start_stack(path, tmp_path_factory.mktemp("async_both"), num_prefill=0,
                           num_decode=0, num_both=1, worker_args=ASYNC)
    except BaseException:
        stop(split.processes)
        raise
    for worker in [*split.workers.values(), *both.workers.values()]:
        assert "asynchronous scheduling on" in worker.log_path.read_text(), worker.name
    yield {"split": split, "both": both}
    stop(split.processes + both.processes)


@pytest.fixture(scope="module")
def offline(checkpoint):
    return LLM(checkpoint("llama").path, dtype="float32", async_scheduling=False)


def idle(stack) -> bool:
    loads = [worker_load(w.address) for w in stack.workers.values()]
    return all(load.kv_usage == 0 and load.num_running == 0 and load.num_pinned == 0
               for load in loads)


@pytest.mark.parametrize("layout", ["split", "both"])
def test_concurrent_streams_equal_the_offline_engine(stacks, offline, layout):
    stack = stacks[layout]
    prompts = random_prompts([3, 11, 25, 40, 7, 60, 18, 33], seed=71)
    cases = [dict(max_tokens=12 + 3 * i, **({"temperature": 0.9, "seed": i} if i % 2 else {}))
             for i in range(len(prompts))]
    expected = offline.generate(prompts, [
        SamplingParams(temperature=case.get("temperature", 0.0), seed=case.get("seed"),
                       max_tokens=case["max_tokens"], min_tokens=case["max_tokens"])
        for case in cases])

    def run(i):
        return generate(stack.router.address, request(prompts[i], **cases[i]))

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(run, range(len(prompts))))
    for result, want in zip(results, expected):
        assert result.token_ids == want.token_ids
    wait_until(lambda: idle(stack), 30)


def test_cancelled_stream_leaves_no_blocks(stacks):
    stack = stacks["split"]
    with grpc.insecure_channel(stack.router.address) as channel:
        # As long as the model allows (512 positions), read only the first chunks: a busy
        # box's client may be slow to read, and the router packs what it waits for into each.
        call = generate_pb2_grpc.GenerateStub(channel).Generate(
            request([7] * 30, max_tokens=470), timeout=60)
        for i, _ in enumerate(call):
            if i == 1:
                break
        assert not idle(stack)
        call.cancel()
    wait_until(lambda: idle(stack), 30)

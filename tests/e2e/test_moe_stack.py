"""A mixture-of-experts model (tiny Qwen3-MoE) served through router -> prefill -> decode:
greedy tokens equal transformers'."""
from __future__ import annotations

import pytest
from helpers.checkpoints import random_prompts
from helpers.client import generate, request, worker_load
from helpers.processes import start_stack, stop

from tandem.v1 import generate_pb2


@pytest.fixture(scope="module")
def moe_stack(moe_checkpoint, tmp_path_factory):
    stack = start_stack(moe_checkpoint("qwen3_moe").path, tmp_path_factory.mktemp("moe_logs"))
    yield stack
    stop(stack.processes)


def test_moe_greedy_tokens_through_prefill_and_decode_equal_transformers(moe_stack,
                                                                          moe_checkpoint):
    ckpt = moe_checkpoint("qwen3_moe")
    for prompt in random_prompts([1, 40, 200], seed=61):
        result = generate(moe_stack.router.address, request(prompt, max_tokens=24))
        assert result.token_ids == ckpt.greedy(prompt, 24), f"prompt of {len(prompt)} tokens"
        assert result.complete.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    for worker in moe_stack.workers.values():  # every block was handed over and freed
        load = worker_load(worker.address)
        assert load.kv_usage == 0 and load.num_pinned == 0

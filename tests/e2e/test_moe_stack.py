"""Every mixture-of-experts family served through router -> prefill -> decode: greedy tokens
equal transformers' (GPT-OSS with prompts longer than its 16-token sliding window; DeepSeek-V3
hands over its MLA latent cache; DeepSeek-V3.2 its latents and indexer keys, with YaRN and
prompts longer than its index_topk of 24). The other DeepSeek variants hand over the same
latent cache; tests/unit/engine/test_disaggregation.py moves theirs between two engines."""
from __future__ import annotations

import pytest
from helpers.checkpoints import random_prompts
from helpers.client import generate, request, worker_load
from helpers.processes import start_stack, stop

from tandem.v1 import generate_pb2

ARCHITECTURES = ["qwen3_moe", "mixtral", "glm4_moe", "gpt_oss", "deepseek_v3", "deepseek_v32"]


@pytest.mark.parametrize("variant", ARCHITECTURES)
def test_moe_greedy_tokens_through_prefill_and_decode_equal_transformers(
        moe_checkpoint, tmp_path, variant):
    ckpt = moe_checkpoint(variant)
    stack = start_stack(ckpt.path, tmp_path)
    try:
        for prompt in random_prompts([1, 40, 200], seed=61):
            result = generate(stack.router.address, request(prompt, max_tokens=24))
            assert result.token_ids == ckpt.greedy(prompt, 24), f"prompt of {len(prompt)} tokens"
            assert result.complete.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        for worker in stack.workers.values():  # every block was handed over and freed
            load = worker_load(worker.address)
            assert load.kv_usage == 0 and load.num_pinned == 0
    finally:
        stop(stack.processes)

"""Greedy tokens and logits of Tandem's models against transformers on the same weights (fp32)."""
from __future__ import annotations

import pytest
import torch
from helpers.checkpoints import (PARITY_LENGTHS, assert_greedy_parity, assert_logits_parity,
                                 random_prompts, relative_error)

from tandem import LLM, SamplingParams

NUM_NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
ALL_VARIANTS = ["llama", "llama_tied", "llama_rope3", "llama_sharded", "qwen3", "qwen3_tied"]


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_greedy_tokens_match_transformers(checkpoint, variant):
    ckpt = checkpoint(variant)
    if variant == "llama_sharded":
        assert (ckpt.path / "model.safetensors.index.json").is_file()
    llm = LLM(ckpt.path, dtype="float32", enable_prefix_caching=False)
    assert_greedy_parity(llm, ckpt, random_prompts(PARITY_LENGTHS, seed=1))


@pytest.mark.parametrize("variant", ["llama", "llama_rope3", "qwen3"])
def test_logits_at_every_position_match_transformers(checkpoint, variant):
    """One paged prefill over prompt + completion; every position's logits vs transformers."""
    assert_logits_parity(checkpoint(variant), num_new_tokens=NUM_NEW_TOKENS)


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_decode_step_logprobs_match_transformers(checkpoint, variant):
    """The logits of each decode step (reported as raw logprobs) vs transformers'."""
    ckpt = checkpoint(variant)
    llm = LLM(ckpt.path, dtype="float32")
    prompts = random_prompts([5, 130], seed=3)
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16, logprobs=5)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        reference = torch.log_softmax(ckpt.logits(prompt + out.token_ids), dim=-1)
        for step, logprob in enumerate(out.logprobs):
            position = len(prompt) - 1 + step
            assert logprob.token_id == out.token_ids[step]
            expected = reference[position]
            top_ids = [token for token, _ in logprob.top_logprobs]
            assert top_ids == expected.topk(5).indices.tolist()
            actual = torch.tensor([value for _, value in logprob.top_logprobs])
            assert relative_error(actual, expected.topk(5).values) < 1e-4


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_parity_with_prefix_caching(checkpoint, variant):
    ckpt = checkpoint(variant)
    # Small token budget: prompts are admitted over several steps, so later ones can hit the
    # blocks earlier ones computed. Half the prompts share a 96-token prefix.
    llm = LLM(ckpt.path, dtype="float32", enable_prefix_caching=True, max_num_batched_tokens=128)
    [shared] = random_prompts([96], seed=4)
    tails = random_prompts([1, 20, 50, 100], seed=5)
    prompts = [shared + tail for tail in tails] + random_prompts([3, 64, 150, 250], seed=6)
    assert_greedy_parity(llm, ckpt, prompts)
    assert llm.engine.block_manager.prefix_cache_hits > 0
    # A second pass over the same prompts is served mostly from the cache.
    again = llm.generate(prompts[:4], GREEDY)
    assert all(out.num_cached_tokens >= 96 for out in again)
    assert [o.token_ids for o in again] == [ckpt.greedy(p, NUM_NEW_TOKENS) for p in prompts[:4]]


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_parity_with_chunked_prefill(checkpoint, variant):
    ckpt = checkpoint(variant)
    llm = LLM(ckpt.path, dtype="float32", max_num_batched_tokens=24,
              enable_prefix_caching=False)
    assert_greedy_parity(llm, ckpt, random_prompts(PARITY_LENGTHS, seed=7))


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_parity_under_preemption(checkpoint, variant, prefix_caching):
    ckpt = checkpoint(variant)
    # 24 blocks x 16 tokens: enough for the longest sequence (332 tokens) but not for all 8.
    llm = LLM(ckpt.path, dtype="float32", block_size=16, num_kv_blocks=24, max_model_len=384,
              enable_prefix_caching=prefix_caching)
    assert_greedy_parity(llm, ckpt, random_prompts(PARITY_LENGTHS, seed=8))
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 24


def test_eos_stops_generation_like_transformers(checkpoint):
    ckpt = checkpoint("llama")
    [prompt] = random_prompts([40], seed=9)
    reference = ckpt.greedy(prompt, NUM_NEW_TOKENS)
    eos = reference[10]  # pretend this token is EOS: generation must stop at its first use
    llm = LLM(ckpt.path, dtype="float32")
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS,
                                                  stop_token_ids=[eos]))
    stop_at = reference.index(eos)
    assert out.token_ids == reference[: stop_at + 1]
    assert out.finish_reason == "stop"

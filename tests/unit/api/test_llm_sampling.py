"""Sampling through the whole engine: seeds, greedy equivalences, logprobs, stop rules."""
from __future__ import annotations

import pytest
from helpers.checkpoints import random_prompts

from tandem import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(checkpoint):
    # A small token budget, so the batch below mixes chunked prefills with decodes over steps.
    return LLM(checkpoint("llama").path, dtype="float32", max_num_batched_tokens=48)


def test_seeded_request_gives_same_tokens_alone_and_in_a_batch(llm):
    [prompt] = random_prompts([25], seed=11)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24,
                            min_tokens=24)
    [alone] = llm.generate([prompt], seeded)
    others = random_prompts([3, 90, 40], seed=12)
    batch = [others[0], others[1], prompt, others[2]]
    params = [SamplingParams(temperature=0.8, max_tokens=30),
              SamplingParams(temperature=1.2, seed=7, max_tokens=10), seeded,
              SamplingParams(temperature=0, max_tokens=5)]
    in_batch = llm.generate(batch, params)[2]
    assert in_batch.token_ids == alone.token_ids
    [other_seed] = llm.generate([prompt], SamplingParams(temperature=1.0, top_p=0.95, seed=99,
                                                         max_tokens=24, min_tokens=24))
    assert other_seed.token_ids != alone.token_ids


def test_top_k_1_and_temperature_0_equal_greedy(llm, checkpoint):
    prompts = random_prompts([9, 130], seed=13)
    expected = [checkpoint("llama").greedy(p, 16) for p in prompts]
    for params in (SamplingParams(temperature=0, max_tokens=16, min_tokens=16),
                   SamplingParams(temperature=1.3, top_k=1, max_tokens=16, min_tokens=16)):
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected


def test_logprobs_are_returned_per_token_when_asked(llm):
    [prompt] = random_prompts([12], seed=14)
    [out] = llm.generate([prompt], SamplingParams(temperature=0.7, seed=3, max_tokens=6,
                                                  logprobs=3))
    assert len(out.logprobs) == len(out.token_ids)
    for token_id, logprob in zip(out.token_ids, out.logprobs):
        assert logprob.token_id == token_id and logprob.logprob <= 0
        assert len(logprob.top_logprobs) == 3 and logprob.rank >= 1
    [plain] = llm.generate([prompt], SamplingParams(max_tokens=2))
    assert plain.logprobs is None


def test_min_tokens_and_ignore_eos(llm, checkpoint):
    [prompt] = random_prompts([30], seed=15)
    reference = checkpoint("llama").greedy(prompt, 16)
    stop = reference[2]
    [early] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16,
                                                    stop_token_ids=[stop]))
    assert early.finish_reason == "stop" and early.token_ids[-1] == stop
    assert len(early.token_ids) == reference.index(stop) + 1
    [late] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, min_tokens=16,
                                                   stop_token_ids=[stop]))
    assert late.finish_reason == "length" and len(late.token_ids) == 16


def test_generation_stops_at_max_model_len(checkpoint):
    llm = LLM(checkpoint("llama").path, dtype="float32", max_model_len=40)
    [prompt] = random_prompts([30], seed=16)
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=100,
                                                  ignore_eos=True))
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == 40


def test_bad_prompts_are_value_errors_and_leave_no_blocks(checkpoint):
    llm = LLM(checkpoint("llama").path, dtype="float32", max_model_len=64)
    free = llm.engine.block_manager.num_free_blocks
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.generate([[1, 2], list(range(64))])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 10**6]])
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]])
    assert llm.engine.block_manager.num_free_blocks == free
    assert not llm.engine.has_unfinished

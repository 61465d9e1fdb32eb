"""A request resumed on another engine from its prompt and the tokens generated so far (the
router's migration) must continue exactly as the undisturbed run: the generated tokens count
as output for max_tokens, min_tokens, penalties and a seeded request's random stream."""
from __future__ import annotations

import pytest
from helpers.checkpoints import random_prompts

from tandem import LLM, SamplingParams
from tandem.common.errors import OutOfRangeError

NUM_TOKENS = 24
CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS),
    "seeded-penalties": SamplingParams(
        temperature=0.8, seed=7, max_tokens=NUM_TOKENS, min_tokens=12,
        repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
}


def run_to_completion(engine):
    while engine.has_unfinished:
        engine.step()


@pytest.fixture(scope="module")
def engines(checkpoint):
    path = checkpoint("llama").path
    return (LLM(path, dtype="float32", max_num_batched_tokens=64).engine,
            LLM(path, dtype="float32").engine)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("num_done", [1, 5, NUM_TOKENS - 1])
def test_resumed_request_continues_the_undisturbed_stream(engines, case, num_done):
    first, second = engines
    params = CASES[case]
    prompt = random_prompts([40], seed=3)[0]
    whole = first.add_request(prompt, params, f"whole-{case}-{num_done}")
    run_to_completion(first)
    expected = whole.completion_token_ids
    assert len(expected) == NUM_TOKENS
    resumed = second.resume_request(prompt, expected[:num_done], params,
                                    f"resumed-{case}-{num_done}")
    run_to_completion(second)
    assert resumed.completion_token_ids == expected
    assert resumed.num_prompt_tokens == len(prompt)
    assert second.block_manager.num_free_blocks == second.block_manager.num_blocks


def test_resume_rejects_a_request_that_is_already_done(engines):
    _, engine = engines
    with pytest.raises(OutOfRangeError, match="max_tokens=2"):
        engine.resume_request([1, 2, 3], [4, 5], SamplingParams(max_tokens=2), "done")
    with pytest.raises(OutOfRangeError, match="outside the vocabulary"):
        engine.resume_request([1, 2, 3], [10**9], SamplingParams(max_tokens=4), "bad")
    assert not engine.requests

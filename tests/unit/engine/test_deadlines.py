"""A request whose deadline passed leaves the engine between steps (mid-prefill included),
freeing its blocks, while requests without one carry on."""
from __future__ import annotations

import time

from tandem import LLM, SamplingParams
from tandem.workers.engine.sequence import FinishReason, SequenceStatus

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_a_long_prompt_is_dropped_between_prefill_chunks_once_its_deadline_passes(checkpoint):
    engine = LLM(checkpoint("llama").path, dtype="float32", max_num_batched_tokens=16).engine
    manager = engine.block_manager
    long = engine.add_request([i % 300 + 1 for i in range(399)], PARAMS, "long",
                              deadline=time.monotonic() + 3600)
    engine.step()
    engine.step()
    assert long.status is SequenceStatus.RUNNING and 0 < long.num_computed_tokens < 399
    long.deadline = time.monotonic() - 1  # passed while its prefill is under way
    small = engine.add_request([5, 6, 7], PARAMS, "small")
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
    assert long.finish_reason is FinishReason.ABORT and "long" not in engine.requests
    assert engine.num_finished["deadline"] == 1
    assert small.num_completion_tokens == 8
    assert steps == 8  # the small request alone: no chunk of the long prompt ran after
    assert manager.num_free_blocks == manager.num_blocks


def test_a_waiting_request_past_its_deadline_is_dropped_before_it_is_scheduled(checkpoint):
    engine = LLM(checkpoint("llama").path, dtype="float32").engine
    late = engine.add_request([1, 2, 3], PARAMS, "late", deadline=time.monotonic() - 0.1)
    assert engine.step() == []
    assert late.finish_reason is FinishReason.ABORT and late.num_computed_tokens == 0
    assert not engine.has_unfinished and not engine.requests

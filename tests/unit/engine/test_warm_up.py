"""The startup warm-up (workers/engine/warm_up.py) on a real tiny engine: every synthetic
request finishes (chunked prompts and a multi-prompt step included), the engine is left idle
with every block free, it still matches transformers afterwards, and a metrics recorder made
after it counts none of it."""
from __future__ import annotations

import pytest
from helpers.checkpoints import random_prompts

from tandem import LLM, SamplingParams
from tandem.common.metrics import WorkerMetrics
from tandem.workers.engine.warm_up import CHUNKED_EXTRA, warm_up
from tandem.workers.metrics_recorder import WorkerMetricsRecorder

GREEDY = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)


def test_warm_up_finishes_everything_and_changes_nothing(checkpoint):
    ckpt = checkpoint("llama")
    engine = LLM(ckpt.path, dtype="float32", max_num_batched_tokens=64).engine
    report = warm_up(engine)
    assert report.num_requests == 7 + 4 + 3 + 16 + 1 and not engine.has_unfinished
    # 11 rounds, each a prefill (the chunked one two or more) and a decode step at least.
    assert report.num_steps >= 2 * 11 + 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.num_finished["length"] == 31 and not engine.requests
    metrics = WorkerMetrics("m", "both")
    recorder = WorkerMetricsRecorder(engine, metrics)
    prompts = random_prompts([5, 90], seed=3)
    seqs = [engine.add_request(p, GREEDY, f"r{i}") for i, p in enumerate(prompts)]
    while engine.has_unfinished:
        recorder.after_step(engine.step())
    for prompt, seq in zip(prompts, seqs):
        assert seq.completion_token_ids == ckpt.greedy(prompt, 8)
    finished = metrics.registry.get_sample_value(
        "tandem:requests_finished_total", {"model": "m", "tier": "both", "status": "length"})
    assert finished == 2  # the warm-up's 31 are not counted


def test_warm_up_fits_a_small_cache_and_refuses_a_busy_engine(checkpoint):
    ckpt = checkpoint("llama")
    engine = LLM(ckpt.path, dtype="float32", num_kv_blocks=24, max_model_len=384,
                 max_num_seqs=2, max_num_batched_tokens=32).engine  # 2 sequences at once
    assert 700 > 24 * 16 and 32 + CHUNKED_EXTRA < 24 * 16 // 2
    report = warm_up(engine)
    assert report.num_requests == 7 + 2 + 2 + 2 + 1 and not engine.has_unfinished
    assert engine.block_manager.num_free_blocks == 24
    engine.add_request([1, 2, 3], GREEDY, "busy")
    with pytest.raises(RuntimeError, match="idle engine"):
        warm_up(engine)

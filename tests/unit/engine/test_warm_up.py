"""The startup warm-up (workers/engine/warm_up.py) on a real tiny engine: every synthetic
request finishes (chunked prompts and a multi-prompt step included), the engine is left idle
with every block free, it still matches transformers afterwards, and a metrics recorder made
after it counts none of it."""
from __future__ import annotations

import pytest
from helpers.checkpoints import random_prompts

from tandem import LLM, SamplingParams
from tandem.common.metrics import WorkerMetrics
from tandem.workers.engine.packed_inputs import TABLE_WIDTH_MULTIPLE
from tandem.workers.engine.warm_up import CHUNKED_EXTRA, CONTINUATIONS, warm_up
from tandem.workers.metrics_recorder import WorkerMetricsRecorder

GREEDY = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)


def test_warm_up_finishes_everything_and_changes_nothing(checkpoint):
    ckpt = checkpoint("llama")
    engine = LLM(ckpt.path, dtype="float32", max_num_batched_tokens=64).engine
    report = warm_up(engine)
    continuing = sum(2 + len(extras) for _, _, extras in CONTINUATIONS)
    assert report.num_requests == 7 + 4 + 3 + 16 + 1 + continuing == 104
    assert not engine.has_unfinished
    # 22 rounds, each a prefill (the chunked and continuing ones two or more) and a decode step.
    assert report.num_steps >= 2 * 22 + 1 + len(CONTINUATIONS)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.num_finished["length"] == 104 and not engine.requests
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
    assert finished == 2  # the warm-up's 104 are not counted


def test_warm_up_fits_a_small_cache_and_refuses_a_busy_engine(checkpoint):
    ckpt = checkpoint("llama")
    engine = LLM(ckpt.path, dtype="float32", num_kv_blocks=24, max_model_len=384,
                 max_num_seqs=2, max_num_batched_tokens=32).engine  # 2 sequences at once
    assert 700 > 24 * 16 and 32 + CHUNKED_EXTRA < 24 * 16 // 2
    report = warm_up(engine)
    # Every round is cut to two prompts: a continuation round keeps its filler and target.
    assert report.num_requests == 7 + 2 + 2 + 2 + 1 + 2 * len(CONTINUATIONS)
    assert not engine.has_unfinished
    assert engine.block_manager.num_free_blocks == 24
    engine.add_request([1, 2, 3], GREEDY, "busy")
    with pytest.raises(RuntimeError, match="idle engine"):
        warm_up(engine)


def test_warm_up_steps_continue_over_cached_context(checkpoint):
    """The continuation rounds reach the steps unified_attention serves on a GPU: one, three
    and sixteen sequences continuing over cached keys (a filler prompt cuts the target at
    c = min(c, budget - 1)), with short and long query runs; every block table is padded to
    a multiple of TABLE_WIDTH_MULTIPLE."""
    engine = LLM(checkpoint("llama").path, dtype="float32", max_num_batched_tokens=256).engine
    runner = engine.runner
    shapes, widths = set(), set()
    prepare = runner.prepare_inputs

    def spy(batch):
        inputs = prepare(batch)
        meta = inputs.meta
        starts, lens = meta.query_start_loc_host, meta.seq_lens_host
        cached = [n - (starts[i + 1] - starts[i]) for i, n in enumerate(lens)]
        if meta.max_query_len > 1 and max(cached) > 0:
            shapes.add((max(cached), len(lens), meta.max_query_len >= 256))
        widths.add(meta.block_tables.shape[1])
        return inputs

    runner.prepare_inputs = spy
    warm_up(engine)
    for cached in (100, 255):  # 600 is cut to the budget's 255
        for num_seqs in (1, 3, 16):
            assert (cached, num_seqs, False) in shapes, (cached, num_seqs, sorted(shapes))
    assert (100, 1, True) in shapes  # 256 new tokens of the 300 (the budget) over 100 cached
    assert all(w % TABLE_WIDTH_MULTIPLE == 0 for w in widths), sorted(widths)

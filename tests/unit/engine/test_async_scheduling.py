"""Asynchronous scheduling (engine.py) queues decode step N+1 before step N's tokens are read.
It must change nothing a caller sees: the same tokens and finish reasons as one step at a time,
for every sampling mode, with requests joining, finishing, aborted and preempted in between,
and no KV block kept or freed early. On CPU the device is the host, so these tests check the
bookkeeping; the overlap itself is measured on a GPU (bench/serve.py)."""
from __future__ import annotations

import asyncio
import json

import pytest
from helpers.checkpoints import random_prompts

from tandem import LLM, SamplingParams
from tandem.common.structured_output import StructuredOutput
from tandem.workers.async_engine import AsyncEngine, TokenEvent
from tandem.workers.engine.sequence import PLACEHOLDER_TOKEN_ID, FinishReason


@pytest.fixture(scope="module")
def engines(checkpoint):
    """(one step at a time, asynchronous), same weights."""
    path = checkpoint("llama").path
    common = dict(dtype="float32", max_num_seqs=6, num_kv_blocks=64)
    return (LLM(path, async_scheduling=False, **common).engine,
            LLM(path, async_scheduling=True, **common).engine)


def run(engine, requests, *, on_step=None):
    """Adds (prompt, params) requests, each after `delay` steps, and steps to the end."""
    seqs, num_steps = {}, 0
    pending = sorted(requests.items(), key=lambda kv: kv[1][2])
    while pending or engine.has_unfinished:
        while pending and pending[0][1][2] <= num_steps:
            rid, (prompt, params, _) = pending.pop(0)
            seqs[rid] = engine.add_request(prompt, params, rid)
        engine.step()
        num_steps += 1
        if on_step is not None:
            on_step(engine, num_steps)
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks, "a KV block was kept"
    manager.check_invariants([])
    return {rid: (seq.completion_token_ids, seq.finish_reason, seq.logprobs)
            for rid, seq in seqs.items()}


def assert_same_outputs(got: dict, expected: dict) -> None:
    """Tokens and finish reasons exactly; logprobs up to float rounding (a grammar's compile
    time decides the step a constrained request joins, so batches, and the last bits of a
    batched matmul, may differ between two runs)."""
    assert {rid: out[:2] for rid, out in got.items()} == \
        {rid: out[:2] for rid, out in expected.items()}
    for rid, (_, _, logprobs) in got.items():
        want = expected[rid][2]
        assert [lp.token_id for lp in logprobs] == [lp.token_id for lp in want], rid
        assert [lp.logprob for lp in logprobs] == pytest.approx(
            [lp.logprob for lp in want], abs=1e-4), rid


MIXED_PROMPTS = random_prompts([5, 17, 33, 2, 40, 9, 21, 12, 14, 26], seed=11)
SCHEMA = StructuredOutput("json_schema", json.dumps({
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string",
                                                                    "maxLength": 6}},
    "required": ["a", "b"]}))


def mixed_requests(stop_token: int | None = None) -> dict:
    """Greedy, sampled (seeded), min/max tokens, stop ids, and rows that need the host between
    steps (logprobs, penalties), arriving at different steps."""
    prompts = MIXED_PROMPTS
    stop = [stop_token] if stop_token is not None else []
    params = [
        SamplingParams(temperature=0, max_tokens=20),
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=18),
        SamplingParams(temperature=0.7, top_k=20, min_p=0.05, seed=9, max_tokens=25,
                       min_tokens=10),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=stop),
        SamplingParams(temperature=1.0, seed=3, max_tokens=16, stop_token_ids=stop),
        SamplingParams(temperature=0, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0.8, seed=1, max_tokens=14, repetition_penalty=1.2),
        SamplingParams(temperature=0, max_tokens=40, structured_output=SCHEMA),
        SamplingParams(temperature=0.9, seed=4, max_tokens=30,
                       structured_output=StructuredOutput("regex", r"[0-9]{2,5}-[a-c]{1,8}")),
    ]
    delays = [0, 0, 1, 3, 5, 8, 12, 20, 2, 4]
    return {f"r{i}": (prompt, p, delay)
            for i, (prompt, p, delay) in enumerate(zip(prompts, params, delays))}


def detokenized(engine, token_ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(engine.config.model).decode(
        token_ids, skip_special_tokens=True)


def test_outputs_equal_one_step_at_a_time(engines):
    sync, asynchronous = engines
    # A token the greedy stream really produces, so stop ids end requests mid-stream.
    probe = run(sync, {"probe": (MIXED_PROMPTS[4], SamplingParams(temperature=0, max_tokens=6),
                                 0)})
    stop_token = probe["probe"][0][4]
    requests = mixed_requests(stop_token)
    for engine in engines:  # compiled before the runs: requests join at the same steps in both
        for _, params, _ in requests.values():
            if params.structured_output is not None:
                engine.grammars.compile(params.structured_output).result()
    ahead = []
    expected = run(sync, requests)
    constrained_ahead = []

    def watch(e, _):
        ahead.append(e._in_flight is not None)
        constrained_ahead.append(e._in_flight is not None and any(
            seq.grammar is not None for seq in e._in_flight.seqs))

    got = run(asynchronous, requests, on_step=watch)
    assert_same_outputs(got, expected)
    assert any(constrained_ahead), "no constrained step was queued ahead"
    assert any(finish is FinishReason.STOP for _, finish, _ in expected.values())
    assert len(got["r6"][2]) == 12 and got["r6"][2][0].top_logprobs  # logprobs rows too
    json.loads(detokenized(asynchronous, got["r8"][0]))  # the constrained rows really were
    assert sum(ahead) >= 3, "no decode step was queued ahead"


def test_min_tokens_blocks_a_stop_token_that_is_the_greedy_choice(engines):
    """The N-th token of a queued step is sampled after its placeholder is appended: the stop
    token must stay masked there (min_tokens=N counts the tokens before it), as it is when
    the same step runs synchronously."""
    sync, asynchronous = engines
    prompt = MIXED_PROMPTS[6]
    probe = run(sync, {"probe": (prompt, SamplingParams(temperature=0, max_tokens=16), 0)})
    greedy = probe["probe"][0]
    # The first position whose greedy token is new: with it as the stop id, nothing before
    # that position changes, and there the stop id is the unmasked argmax.
    n = next(i + 1 for i in range(2, len(greedy)) if greedy[i] not in greedy[:i])
    params = SamplingParams(temperature=0, max_tokens=n + 4, min_tokens=n,
                            stop_token_ids=[greedy[n - 1]])
    expected = run(sync, {"r": (prompt, params, 0)})
    assert greedy[n - 1] not in expected["r"][0][:n] and len(expected["r"][0]) > n
    got = run(asynchronous, {"r": (prompt, params, 0)})
    assert got["r"][:2] == expected["r"][:2]


def test_greedy_batch_runs_ahead_every_decode_step(engines):
    _, asynchronous = engines
    prompts = random_prompts([8, 8, 8], seed=2)
    requests = {f"g{i}": (p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), 0)
                for i, p in enumerate(prompts)}
    returned = []
    got = run(asynchronous, requests,
              on_step=lambda e, _: returned.append(e.last_step is not None))
    assert all(len(tokens) == 12 for tokens, _, _ in got.values())
    # 1 prefill step, 1 step that only queues the first decode, 11 that each read one decode
    # step's tokens while queueing the next, and 1 that reads the last.
    assert len(returned) == 14 and returned.count(False) == 1


def test_decode_runs_ahead_while_requests_wait_for_a_free_slot(engines):
    sync, asynchronous = engines  # max_num_seqs=6: the last 4 of 10 wait
    prompts = random_prompts([6] * 10, seed=12)
    requests = {f"w{i}": (p, SamplingParams(temperature=0, max_tokens=8 + i), 0)
                for i, p in enumerate(prompts)}
    waiting_ahead = []  # per step: it read a step's tokens with the next one already queued
    got = run(asynchronous, requests, on_step=lambda e, _: waiting_ahead.append(
        e.last_step is not None and e._in_flight is not None and bool(e.scheduler.waiting)))
    assert got == run(sync, requests)
    assert any(waiting_ahead), "no step was queued ahead while requests waited"


def test_preemption_and_a_small_cache_give_the_same_tokens(checkpoint):
    path = checkpoint("llama").path
    common = dict(dtype="float32", max_num_seqs=4, num_kv_blocks=9, block_size=16,
                  max_model_len=128)
    prompts = random_prompts([30, 30, 30, 30], seed=4)
    requests = {f"p{i}": (p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), 0)
                for i, p in enumerate(prompts)}
    sync = LLM(path, async_scheduling=False, **common).engine
    asynchronous = LLM(path, async_scheduling=True, **common).engine
    assert run(asynchronous, requests) == run(sync, requests)
    assert asynchronous.scheduler.num_preemptions > 0


def test_abort_while_a_step_is_queued_frees_blocks_after_it(engines):
    _, engine = engines
    prompts = random_prompts([20, 20], seed=6)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kept = engine.add_request(prompts[0], params, "kept")
    aborted = engine.add_request(prompts[1], params, "aborted")
    while engine._in_flight is None:
        engine.step()
    manager = engine.block_manager
    free_before = manager.num_free_blocks
    engine.abort("aborted")
    assert aborted.is_finished and aborted.num_inflight_tokens == 0
    assert PLACEHOLDER_TOKEN_ID not in aborted.token_ids
    assert manager.num_free_blocks == free_before, "freed while a queued step may write them"
    while engine.has_unfinished:
        engine.step()
    assert len(kept.completion_token_ids) == 40
    assert manager.num_free_blocks == manager.num_blocks


def test_deadline_passing_while_a_step_is_queued(engines):
    _, engine = engines
    [prompt] = random_prompts([10], seed=8)
    seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=50), "late",
                             deadline=None)
    while engine._in_flight is None:
        engine.step()
    seq.deadline = 0.0  # already past
    while engine.has_unfinished:
        engine.step()
    assert seq.finish_reason is FinishReason.ABORT
    assert PLACEHOLDER_TOKEN_ID not in seq.token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_async_engine_streams_carry_real_tokens(engines):
    sync, asynchronous = engines
    prompts = random_prompts([12, 25], seed=9)
    params = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True, logprobs=1)
    expected = run(sync, {f"s{i}": (p, params, 0) for i, p in enumerate(prompts)})

    async def stream_all():
        runner = AsyncEngine(asynchronous)
        runner.start()
        try:
            streams = {f"s{i}": runner.open_stream(f"s{i}") for i in range(len(prompts))}
            # All in one command, so the batches (and so the logprobs' last bits) are run()'s.
            await runner.call(lambda e: [e.add_request(prompt, params, f"s{i}")
                                         for i, prompt in enumerate(prompts)])
            out = {}
            for rid, stream in streams.items():
                tokens, logprobs = [], []
                while True:
                    event = await asyncio.wait_for(stream.get(), 60)
                    assert isinstance(event, TokenEvent)
                    tokens.append(event.token_id)
                    logprobs.append(event.logprob)
                    if event.finish_reason is not None:
                        out[rid] = (tokens, event.finish_reason, logprobs)
                        break
            return out
        finally:
            await runner.stop()

    assert_same_outputs(asyncio.run(stream_all()), expected)

"""Request migration on real processes: a decode worker SIGKILLed mid-stream (greedy and
seeded), the migration limit, and a prefill worker that is gone when a request reaches it.
The client must see exactly the tokens of an undisturbed run. (A frozen decode worker:
test_router_faults_e2e.py.)"""
from __future__ import annotations

import random
import signal

import grpc
import pytest
from helpers.client import generate, request, router_counter, worker_load
from helpers.processes import start_metered_stack, stop

NUM_TOKENS = 300  # ~7 ms a token on CPU: a couple of seconds of streaming
PROMPT = [5, 17, 29, 41, 53, 65, 77, 89] * 4


def kill_serving_decode_worker(stack, killed: list[str]) -> None:
    """SIGKILL the live decode (or both) worker that is running the (only) request."""
    serving = [w for name, w in stack.workers.items() if not name.startswith("prefill")
               and w.is_alive() and worker_load(w.address).num_running >= 1]
    assert len(serving) == 1, "the stream was not running on exactly one worker"
    serving[0].popen.send_signal(signal.SIGKILL)
    serving[0].popen.wait(timeout=10)
    killed.append(serving[0].address)


GREEDY, SEEDED = dict(temperature=0.0), dict(temperature=0.8, seed=1234)
DISAGGREGATED = dict(num_decode=2)  # 1 prefill + 2 decode
AGGREGATED = dict(num_prefill=0, num_decode=0, num_both=2)


@pytest.mark.slow
@pytest.mark.parametrize("sampling,workers", [(GREEDY, DISAGGREGATED), (SEEDED, DISAGGREGATED),
                                              (SEEDED, AGGREGATED)],
                         ids=["greedy", "seeded", "seeded-aggregated"])
def test_killed_decode_worker_stream_continues_with_the_undisturbed_tokens(
        checkpoint, tmp_path, sampling, workers):
    stack = start_metered_stack(checkpoint, tmp_path, **workers)
    try:
        message = request(PROMPT, max_tokens=NUM_TOKENS, **sampling)
        undisturbed = generate(stack.router.address, message)
        assert len(undisturbed.token_ids) == NUM_TOKENS
        # Early enough that a client lagging far behind the worker on a busy box still meets
        # a running stream.
        kill_at = random.Random().randrange(5, 30)
        killed: list[str] = []

        def on_tokens(num_tokens):
            if num_tokens >= kill_at and not killed:
                kill_serving_decode_worker(stack, killed)

        result = generate(stack.router.address, message, timeout=120, on_tokens=on_tokens)
        log = f"killed at token {kill_at}; router log:\n{stack.router.log_tail()}"
        assert killed, f"the stream ended before token {kill_at}"
        assert result.token_ids == undisturbed.token_ids, log
        assert result.text == undisturbed.text
        assert result.complete.usage.num_migrations == 1, log
        assert result.complete.usage.completion_tokens == NUM_TOKENS
        assert router_counter(stack.router_metrics, "tandem:request_migrations") == 1, log
    finally:
        stop(stack.processes)


@pytest.mark.slow
def test_migration_limit_reached_ends_unavailable_naming_each_attempt(checkpoint, tmp_path):
    """--migration-limit 1 with two decode workers: the first death migrates the stream, the
    second ends it, naming both failed workers."""
    stack = start_metered_stack(checkpoint, tmp_path, num_decode=2,
                                router_args=["--migration-limit", "1"])
    try:
        killed: list[str] = []
        kills_at = [20, 60]

        def on_tokens(num_tokens):
            if len(killed) < len(kills_at) and num_tokens >= kills_at[len(killed)]:
                kill_serving_decode_worker(stack, killed)

        with pytest.raises(grpc.RpcError) as info:
            generate(stack.router.address, request(PROMPT, max_tokens=NUM_TOKENS), timeout=120,
                     on_tokens=on_tokens)
        assert len(killed) == 2
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        details = info.value.details()
        assert "--migration-limit 1" in details, details
        for i, address in enumerate(killed):
            assert f"attempt {i + 1}: decode worker {address}" in details, details
    finally:
        stop(stack.processes)


@pytest.mark.slow
def test_request_on_a_dead_prefill_worker_is_retried_on_another(checkpoint, tmp_path):
    """Health checks are slow (60 s) here, so the router learns that a prefill worker is gone
    only from a request sent to it: that request must be retried on the other one."""
    stack = start_metered_stack(checkpoint, tmp_path, num_prefill=2,
                                router_args=["--health-check-interval", "60"])
    try:
        prompts = [[7 + i] * 24 for i in range(4)]
        expected = [generate(stack.router.address, request(p, max_tokens=12)).token_ids
                    for p in prompts]
        # Idle workers tie, so the router keeps picking the same one: kill that one.
        victim = max((w for name, w in stack.workers.items() if name.startswith("prefill")),
                     key=lambda w: router_counter(stack.router_metrics,
                                                  "tandem:routing_decisions",
                                                  worker=w.address))
        victim.popen.send_signal(signal.SIGKILL)
        victim.popen.wait(timeout=10)
        results = [generate(stack.router.address, request(p, max_tokens=12))
                   for p in prompts]
        assert [r.token_ids for r in results] == expected
        assert sum(r.complete.usage.num_migrations for r in results) == 1
        assert router_counter(stack.router_metrics, "tandem:request_migrations",
                              cause="unavailable") == 1
        assert router_counter(stack.router_metrics, "tandem:worker_ejections",
                              worker=victim.address) == 1
    finally:
        stop(stack.processes)

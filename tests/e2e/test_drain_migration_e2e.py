"""A decode worker drained by SIGTERM finishes what it can within `--shutdown-grace-seconds`;
the streams still running when the grace ends move to the other decode worker, and every
client gets the tokens of an undisturbed run."""
from __future__ import annotations

import signal
import threading

import pytest
from helpers.client import Result, generate, request, router_counter, worker_load
from helpers.processes import start_metered_stack, stop

# 32 + 460 tokens fit the tiny Llama's 512 positions. Alone, such a stream takes about 0.6 s
# on a CPU core, two at once longer: several times the 0.2 s grace.
NUM_TOKENS = 460
PROMPTS = [[5, 17, 29, 41, 53, 65, 77, 89] * 4, [7, 11, 13, 19, 23, 31, 37, 43] * 4]
NUM_STREAMS = 4
SIGTERM_AFTER_TOKENS = 10


@pytest.mark.slow
def test_sigterm_drained_decode_worker_hands_its_streams_over(checkpoint, tmp_path):
    stack = start_metered_stack(checkpoint, tmp_path, num_decode=2,
                                role_args={"decode": ["--shutdown-grace-seconds", "0.2"]})
    try:
        messages = [request(PROMPTS[i % len(PROMPTS)], max_tokens=NUM_TOKENS)
                    for i in range(NUM_STREAMS)]
        undisturbed = [generate(stack.router.address, m, timeout=120) for m in messages[:2]]
        started = [threading.Event() for _ in range(NUM_STREAMS)]
        results: list[Result | Exception | None] = [None] * NUM_STREAMS

        def run(index: int) -> None:
            def on_tokens(num_tokens):
                if num_tokens >= SIGTERM_AFTER_TOKENS:
                    started[index].set()
            try:
                results[index] = generate(stack.router.address, messages[index], timeout=300,
                                          on_tokens=on_tokens)
            except Exception as exc:  # reported below, with the stream's index
                results[index] = exc
                started[index].set()

        threads = [threading.Thread(target=run, args=(i,), daemon=True)
                   for i in range(NUM_STREAMS)]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(120), "a stream got no tokens within 120 s"
        decode_workers = [w for name, w in stack.workers.items() if name.startswith("decode")]
        drained = max(decode_workers, key=lambda w: worker_load(w.address).num_running)
        num_draining = worker_load(drained.address).num_running
        assert num_draining >= 1, "no stream was running on a decode worker"
        drained.popen.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(300)
        assert drained.popen.wait(60) == 0
        log = f"router log:\n{stack.router.log_tail(60)}\n{drained.log_path.read_text()[-3000:]}"
        for index, result in enumerate(results):
            assert isinstance(result, Result), f"stream {index}: {result!r}\n{log}"
            assert result.token_ids == undisturbed[index % 2].token_ids, f"stream {index}"
            assert result.text == undisturbed[index % 2].text
        migrations = sum(result.complete.usage.num_migrations for result in results)
        assert 1 <= migrations <= num_draining, log
        assert router_counter(stack.router_metrics, "tandem:request_migrations") == migrations
    finally:
        stop(stack.processes)

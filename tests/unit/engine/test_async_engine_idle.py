"""An idle AsyncEngine thread sleeps until a command comes or a pinned KV lease is due."""
from __future__ import annotations

import asyncio
import time

import pytest
from helpers.checkpoints import random_prompts

from tandem import LLM, SamplingParams
from tandem.workers.async_engine import AsyncEngine


@pytest.mark.slow
def test_idle_engine_thread_sleeps_and_still_expires_leases_when_due(checkpoint):
    engine = LLM(checkpoint("llama").path, dtype="float32", kv_lease_seconds=0.5).engine
    idle_wake_ups = []
    [prompt] = random_prompts([20], seed=5)

    async def run():
        async_engine = AsyncEngine(engine, on_step=lambda updated: idle_wake_ups.append(
            time.monotonic()) if updated is None else None)
        async_engine.start()
        try:
            await asyncio.sleep(0.2)
            window_start = time.monotonic()
            await asyncio.sleep(1.5)
            num_idle = sum(window_start <= t for t in idle_wake_ups)
            await async_engine.call(lambda e: e.add_request(
                prompt, SamplingParams(temperature=0, max_tokens=4), "p",
                pin_after_prefill=True))
            deadline = time.monotonic() + 30
            while await async_engine.call(lambda e: e.has_unfinished or "p" in e.pinned):
                assert time.monotonic() < deadline, "the lease never expired"
                await asyncio.sleep(0.05)
            return num_idle, await async_engine.call(lambda e: e.num_expired_leases)
        finally:
            await async_engine.stop()

    num_idle, num_expired = asyncio.run(run())
    assert num_idle <= 4, f"{num_idle} idle wake-ups in 1.5 s"  # polling woke ~30 times
    assert num_expired == 1

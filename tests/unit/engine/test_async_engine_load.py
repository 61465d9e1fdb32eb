"""AsyncEngine.load (what GetLoad reports) over a real engine: the engine thread publishes it
before handing a result to the event loop, so a caller that has seen a token, a command's
answer or an abort reads a load that already includes it, with no command and no waiting."""
from __future__ import annotations

import asyncio
import time

import pytest
from helpers.checkpoints import random_prompts

from tandem import LLM, SamplingParams
from tandem.workers.async_engine import AsyncEngine, EngineLoad

STALL_SECONDS = 1.0


@pytest.mark.slow
def test_the_published_load_includes_every_result_the_loop_has_seen(checkpoint):
    engine = LLM(checkpoint("llama").path, dtype="float32", kv_lease_seconds=60).engine
    pinned_prompt, second_prompt = random_prompts([20, 20], seed=11)
    params = SamplingParams(temperature=0, max_tokens=4)

    async def run() -> list[EngineLoad]:
        async_engine = AsyncEngine(engine)
        loads = [async_engine.load]  # published at construction: an idle engine
        async_engine.start()
        try:
            stream = async_engine.open_stream("p")
            await async_engine.add_request(pinned_prompt, params, "p", pin_after_prefill=True)
            event = await asyncio.wait_for(stream.get(), 60)
            assert event.is_pinned
            loads.append(async_engine.load)  # the pin's step published before its token
            assert async_engine.holds_request("p")
            assert await async_engine.release_kv("p")
            loads.append(async_engine.load)  # the release published before its answer
            assert not async_engine.holds_request("p")
            # An abort answered while the engine thread is still busy with the next command
            # (a stall queued right behind it) is in the load already.
            stream = async_engine.open_stream("q")
            await async_engine.add_request(second_prompt, params, "q", pin_after_prefill=True)
            assert (await asyncio.wait_for(stream.get(), 60)).is_pinned
            aborted = async_engine.abort_soon("q")
            stall = async_engine.submit(lambda e: time.sleep(STALL_SECONDS))
            assert await asyncio.wrap_future(aborted)
            loads.append(async_engine.load)
            assert not async_engine.holds_request("q")
            await asyncio.wrap_future(stall)
            return loads
        finally:
            await async_engine.stop()

    idle, pinned, released, aborted = asyncio.run(run())
    assert idle == EngineLoad(num_running=0, num_waiting=0, kv_usage=0.0,
                              num_free_blocks=idle.num_free_blocks, num_pinned=0)
    assert idle.num_free_blocks > 0
    assert pinned.num_pinned == 1 and pinned.kv_usage > 0 and pinned.num_running == 0
    assert pinned.num_free_blocks < idle.num_free_blocks
    assert released == idle, "releasing the pin frees its blocks in the same published load"
    assert aborted == idle

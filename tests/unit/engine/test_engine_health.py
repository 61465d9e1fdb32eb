"""The worker's health follows its engine thread: NOT_SERVING while one step or command runs
past the stall limit, SERVING again once the thread progresses; a busy engine whose steps
finish stays SERVING. Real engine, AsyncEngine thread and grpc.aio health server."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from helpers.processes import free_port

from tandem import LLM, SamplingParams
from tandem.workers.async_engine import AsyncEngine
from tandem.workers.engine_health import NOT_SERVING, SERVING, EngineHealthWatch

STALL_SECONDS = 0.5


@pytest.fixture(scope="module")
def engine(checkpoint):
    return LLM(checkpoint("llama").path, dtype="float32").engine


def watch_health(engine, during, stall_seconds: float = STALL_SECONDS) -> list[int]:
    """Starts the engine thread, a health server and its watch, runs during(async_engine),
    and returns the distinct statuses a client saw, in order, while it ran and 1 s after."""

    async def main() -> list[int]:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        address = f"127.0.0.1:{free_port()}"
        server.add_insecure_port(address)
        await server.start()
        await servicer.set("", SERVING)
        watch = EngineHealthWatch(async_engine, servicer, [""], stall_seconds)
        watch.start()
        seen: list[int] = []
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                work = asyncio.create_task(during(async_engine))
                end = None
                while end is None or time.monotonic() < end:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    if not seen or seen[-1] != reply.status:
                        seen.append(reply.status)
                    if end is None and work.done():
                        end = time.monotonic() + 1.0
                    await asyncio.sleep(0.05)
                await work
        finally:
            await watch.stop()
            await server.stop(None)
            await async_engine.stop()
        return seen

    return asyncio.run(main())


def test_a_stuck_engine_thread_turns_health_not_serving_until_it_progresses(engine):
    async def block_the_engine_thread(async_engine):
        await async_engine.call(lambda e: time.sleep(4 * STALL_SECONDS))

    assert watch_health(engine, block_the_engine_thread) == [SERVING, NOT_SERVING, SERVING]


def test_a_busy_engine_that_keeps_stepping_stays_serving(engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def generate(async_engine):
        streams = [async_engine.open_stream(f"r{i}") for i in range(16)]
        for i in range(16):
            await async_engine.call(lambda e, i=i: e.add_request([1 + i] * 30, params, f"r{i}"))
        for stream in streams:
            while (await stream.get()).finish_reason is None:
                pass

    # A limit far above a tiny model's step, so a loaded CI box cannot trip it.
    assert watch_health(engine, generate, stall_seconds=2.0) == [SERVING]

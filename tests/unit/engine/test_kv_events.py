"""A worker's KV event publisher (workers/kv_events.py) over a real engine and a real gRPC
stream: a subscriber that falls behind is cut off with RESOURCE_EXHAUSTED, and subscribing
again starts from a snapshot of what the cache holds."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from helpers.checkpoints import random_prompts

from tandem import LLM, SamplingParams
from tandem.common.block_hash import prefix_block_hashes
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.workers.async_engine import AsyncEngine
from tandem.workers.kv_events import KVEventPublisher

BLOCK_SIZE = 4


class PausedSubscriptions(worker_pb2_grpc.WorkerServicer):
    """SubscribeKVEvents whose subscriber reads the snapshot, then nothing until `resume`."""

    def __init__(self, publisher: KVEventPublisher) -> None:
        self.publisher = publisher
        self.resume = asyncio.Event()

    async def SubscribeKVEvents(self, request, context):
        events = self.publisher.subscribe(context)
        yield await anext(events)
        await self.resume.wait()
        async for message in events:
            yield message


async def _run_to_completion(engine: AsyncEngine, prompt: list[int], request_id: str) -> None:
    await engine.call(lambda e: e.add_request(
        prompt, SamplingParams(temperature=0, max_tokens=2), request_id))
    deadline = time.monotonic() + 60
    while await engine.call(lambda e: e.has_unfinished):
        assert time.monotonic() < deadline, f"{request_id} never finished"
        await asyncio.sleep(0.02)


@pytest.mark.slow
def test_a_subscriber_that_falls_behind_is_cut_off_and_resubscribes_to_a_snapshot(checkpoint):
    llm = LLM(checkpoint("llama").path, dtype="float32", block_size=BLOCK_SIZE)
    prompts = random_prompts([21, 21, 21], seed=7)

    async def run():
        engine = AsyncEngine(llm.engine)
        engine.start()
        publisher = KVEventPublisher(engine, max_unread_batches=2)
        servicer = PausedSubscriptions(publisher)
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                behind = stub.SubscribeKVEvents(worker_pb2.SubscribeKVEventsRequest(), timeout=60)
                snapshot = await behind.read()
                assert snapshot.is_snapshot and not snapshot.stored_hashes
                # One request at a time: each one's blocks reach the publisher in a batch of
                # their own, three batches for a subscriber allowed two unread.
                for index, prompt in enumerate(prompts):
                    await _run_to_completion(engine, prompt, f"r{index}")
                servicer.resume.set()
                with pytest.raises(grpc.aio.AioRpcError) as cut_off:
                    while True:
                        await behind.read()
                assert cut_off.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                again = stub.SubscribeKVEvents(worker_pb2.SubscribeKVEventsRequest(), timeout=60)
                snapshot = await again.read()
                again.cancel()
                return snapshot
        finally:
            await server.stop(None)
            await engine.stop()

    try:
        snapshot = asyncio.run(run())
    finally:
        llm.shutdown()
    assert snapshot.is_snapshot and snapshot.block_size == BLOCK_SIZE
    for prompt in prompts:
        assert set(prefix_block_hashes(prompt, BLOCK_SIZE)) <= set(snapshot.stored_hashes)

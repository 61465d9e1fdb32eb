"""The router's KV event follower against a real gRPC server: it outlives its worker's channel."""
from __future__ import annotations

import asyncio
import time

import grpc

from tandem.router.kv_index import KVEventFeed, KVIndex
from tandem.router.worker_pool import WorkerPool
from tandem.v1 import worker_pb2, worker_pb2_grpc

HASHES = [11, 22, 33]


class KVEventsOnly(worker_pb2_grpc.WorkerServicer):
    """A worker that streams a snapshot of HASHES to each subscriber and then stays quiet. It
    serves no health service, so every health check fails and the pool keeps it out."""

    def __init__(self) -> None:
        self.num_subscriptions = 0

    async def SubscribeKVEvents(self, request, context):
        self.num_subscriptions += 1
        yield worker_pb2.SubscribeKVEventsResponse(is_snapshot=True, block_size=4,
                                                   stored_hashes=HASHES)
        await asyncio.Event().wait()


async def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


def test_the_follower_resubscribes_when_the_pool_replaces_the_workers_channel():
    """An unhealthy worker's failed check makes the pool open a new channel and close the old
    one, which cancels the subscription on it (CancelledError inside the follower). The
    follower must take the new channel, not end: a worker restarted at its address would
    otherwise never be followed again."""

    async def main():
        standin = KVEventsOnly()
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(standin, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        index = KVIndex()
        feed = KVEventFeed(index)
        pool = WorkerPool([], [], [address])
        pool.on_added.append(feed.follow)
        try:
            await pool.refresh()  # adds the worker (the follower starts); its check fails
            (worker,) = pool.workers
            assert not worker.is_healthy
            await wait_for(lambda: index.num_blocks(address) == len(HASHES))
            first_channel = worker.channel
            await pool.check_all()  # fails again, with the subscription open: a new channel
            assert worker.channel is not first_channel
            await wait_for(lambda: standin.num_subscriptions == 2)
            await wait_for(lambda: index.num_blocks(address) == len(HASHES))
            assert feed._tasks.get(worker) is not None and not feed._tasks[worker].done()
        finally:
            await feed.close()
            await pool.close()
            await server.stop(None)
        assert index.num_blocks(address) == 0  # an ended follower forgets its worker

    asyncio.run(asyncio.wait_for(main(), 60))

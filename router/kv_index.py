"""Which prefix-cache blocks each worker holds, fed by the workers' KV event streams.

The router subscribes to every worker's SubscribeKVEvents: a snapshot, then changes. A stream
that breaks (worker killed, restarted, network) drops that worker's blocks from the index at
once, and the next subscription starts again from a snapshot, so the index cannot drift from
the worker's cache. Every router replica follows every worker the same way, so replicas agree
on where a prefix is without sharing state.

The index is inverted (block hash -> workers holding it) so that matching a prompt walks the
prompt's blocks once for all workers, stopping at the first block nobody holds.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable

import grpc

from tandem.common.logging import get_logger
from tandem.common.metrics import RouterMetrics
from tandem.v1 import worker_pb2

logger = get_logger(__name__)
RESUBSCRIBE_MIN_SECONDS = 0.2  # first wait after a broken stream; doubles up to the max
RESUBSCRIBE_MAX_SECONDS = 5.0


class KVIndex:
    """Block hashes per worker address, with each worker's block size."""

    def __init__(self) -> None:
        self._held: dict[str, set[int]] = {}  # address -> hashes it holds
        self._holders: dict[int, set[str]] = {}  # hash -> addresses holding it
        self.block_sizes: dict[str, int] = {}  # address -> tokens per block

    def apply(self, address: str, message: worker_pb2.SubscribeKVEventsResponse) -> None:
        """Applies one message of a worker's KV event stream."""
        if message.is_snapshot or message.cleared:
            self.forget(address)
        self.block_sizes[address] = message.block_size
        held = self._held.setdefault(address, set())
        for block_hash in message.evicted_hashes:
            if block_hash in held:
                held.discard(block_hash)
                holders = self._holders[block_hash]
                holders.discard(address)
                if not holders:
                    del self._holders[block_hash]
        for block_hash in message.stored_hashes:
            if block_hash not in held:
                held.add(block_hash)
                self._holders.setdefault(block_hash, set()).add(address)

    def forget(self, address: str) -> None:
        """Drops every block of a worker (its stream broke, or it left the pool)."""
        for block_hash in self._held.pop(address, ()):
            holders = self._holders[block_hash]
            holders.discard(address)
            if not holders:
                del self._holders[block_hash]
        self.block_sizes.pop(address, None)

    def num_blocks(self, address: str) -> int:
        return len(self._held.get(address, ()))

    @property
    def num_hashes(self) -> int:
        """Distinct block hashes held by any worker."""
        return len(self._holders)

    def matched_blocks(self, prompt_hashes: Iterable[int], addresses: Iterable[str]
                       ) -> dict[str, int]:
        """For each address: how many leading blocks of the prompt (given by their chained
        hashes) it holds. Walks the prompt once for all addresses and reads no hash past the
        first block none of them holds (PromptBlockHashes computes only the hashes read)."""
        matched = dict.fromkeys(addresses, 0)
        alive = {address for address in matched if address in self._held}
        num_matched = 0
        if alive:
            for block_hash in prompt_hashes:
                holders = self._holders.get(block_hash)
                if holders is None:
                    break
                if not alive <= holders:
                    still = alive & holders
                    for address in alive - still:
                        matched[address] = num_matched
                    alive = still
                    if not alive:
                        break
                num_matched += 1
        for address in alive:
            matched[address] = num_matched
        return matched


class KVEventFeed:
    """One subscription per worker, feeding a KVIndex; resubscribes after a broken stream."""

    def __init__(self, index: KVIndex, metrics: RouterMetrics | None = None) -> None:
        self.index = index
        self.metrics = metrics
        self._tasks: dict[object, asyncio.Task] = {}  # WorkerEndpoint -> its follower

    def follow(self, worker) -> None:
        """Starts following a WorkerEndpoint (a WorkerPool.on_added callback)."""
        self._tasks[worker] = asyncio.get_running_loop().create_task(self._follow(worker))

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    async def _follow(self, worker) -> None:
        address = worker.address
        wait = RESUBSCRIBE_MIN_SECONDS
        if self.metrics is not None:  # the series exists (at 0) before the first reconnect
            self.metrics.kv_event_reconnects.labels(worker=address, role=worker.role)
        try:
            while not worker.is_removed:
                try:
                    # The pool may replace the worker's channel: take the current stub.
                    call = worker.stub.SubscribeKVEvents(worker_pb2.SubscribeKVEventsRequest())
                    async for message in call:
                        if message.is_snapshot:
                            wait = RESUBSCRIBE_MIN_SECONDS
                        self.index.apply(address, message)
                        self._export_size(worker)
                    reason = "the stream ended"
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                        logger.warning("%s worker %s has no KV events; routing to it ignores "
                                       "its cache", worker.role, address)
                        return
                    reason = f"{exc.code().name}: {exc.details()}"
                if self.index.num_blocks(address) or worker.is_healthy:
                    logger.info("KV events of %s worker %s: %s; resubscribing", worker.role,
                                address, reason)
                self.index.forget(address)
                self._export_size(worker)
                if self.metrics is not None:
                    self.metrics.kv_event_reconnects.labels(worker=address,
                                                            role=worker.role).inc()
                await asyncio.sleep(wait)
                wait = min(RESUBSCRIBE_MAX_SECONDS, wait * 2)
        finally:
            self._tasks.pop(worker, None)
            # A worker re-added at the same address has a follower of its own: leave its data.
            if not any(other.address == address for other in self._tasks):
                self.index.forget(address)
                self._export_size(worker)

    def _export_size(self, worker) -> None:
        if self.metrics is not None:
            self.metrics.kv_index_blocks.labels(worker=worker.address, role=worker.role).set(
                self.index.num_blocks(worker.address))

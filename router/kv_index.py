"""Which prefix-cache blocks each worker holds, fed by the workers' KV event streams.

The router subscribes to every worker's SubscribeKVEvents: a snapshot, then changes. A stream
that breaks (worker killed, restarted, network) drops that worker's blocks from the index at
once, and the next subscription starts again from a snapshot, so the index cannot drift from
the worker's cache. Every router replica follows every worker the same way, so replicas agree
on where a prefix is without sharing state.

The index is inverted (block hash -> workers holding it) so that matching a prompt probes a
few of its blocks once for all workers (matched_blocks).
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from tandem.common.block_hash import PromptBlockHashes
from tandem.common.logging import get_logger
from tandem.common.metrics import RouterMetrics
from tandem.v1 import worker_pb2

logger = get_logger(__name__)
RESUBSCRIBE_MIN_SECONDS = 0.2  # first wait after a broken stream; doubles up to the max
RESUBSCRIBE_MAX_SECONDS = 5.0


class KVIndex:
    """Block hashes per worker address, with each worker's block size.

    Each worker followed gets a bit; a hash maps to the bits of the workers holding it, so
    matching intersects integers, and the index's hundreds of thousands of entries are dicts of
    plain integers, which Python's cyclic garbage collector does not track or scan.
    """

    def __init__(self) -> None:
        self._held: dict[str, dict[int, None]] = {}  # address -> hashes it holds (ordered set)
        self._holders: dict[int, int] = {}  # hash -> bits of the workers holding it
        self._bits: dict[str, int] = {}  # address -> its bit, while it holds a set
        self.block_sizes: dict[str, int] = {}  # address -> tokens per block
        # address -> (its bit, its block size): what matching a prompt needs of each worker,
        # in one lookup.
        self.followed: dict[str, tuple[int, int]] = {}

    def apply(self, address: str, message: worker_pb2.SubscribeKVEventsResponse) -> None:
        """Applies one message of a worker's KV event stream."""
        if message.is_snapshot or message.cleared:
            self.forget(address)
        self.block_sizes[address] = message.block_size
        held = self._held.setdefault(address, {})
        bit = self._bit(address)
        self.followed[address] = (bit, message.block_size)
        holders = self._holders
        for block_hash in message.evicted_hashes:
            if block_hash in held:
                del held[block_hash]
                remaining = holders[block_hash] & ~bit
                if remaining:
                    holders[block_hash] = remaining
                else:
                    del holders[block_hash]
        for block_hash in message.stored_hashes:
            if block_hash not in held:
                held[block_hash] = None
                holders[block_hash] = holders.get(block_hash, 0) | bit

    def forget(self, address: str) -> None:
        """Drops every block of a worker (its stream broke, or it left the pool)."""
        bit = self._bits.pop(address, 0)
        holders = self._holders
        for block_hash in self._held.pop(address, ()):
            remaining = holders[block_hash] & ~bit
            if remaining:
                holders[block_hash] = remaining
            else:
                del holders[block_hash]
        self.block_sizes.pop(address, None)
        self.followed.pop(address, None)

    def num_blocks(self, address: str) -> int:
        return len(self._held.get(address, ()))

    @property
    def num_hashes(self) -> int:
        """Distinct block hashes held by any worker."""
        return len(self._holders)

    def _bit(self, address: str) -> int:
        """The address's bit: the lowest one no other followed worker has."""
        bit = self._bits.get(address)
        if bit is None:
            taken = 0
            for other in self._bits.values():
                taken |= other
            bit = self._bits[address] = ~taken & (taken + 1)
        return bit

    def matched_blocks(self, prompt: PromptBlockHashes, addresses: Sequence[str]
                       ) -> dict[str, int]:
        """For each address: how many leading blocks of the prompt it holds."""
        alive = 0
        for address in addresses:
            alive |= self._bits.get(address, 0)
        counts = self.matched_by_bit(prompt, alive)
        return {address: counts.get(self._bits.get(address, 0), 0) for address in addresses}

    def matched_by_bit(self, prompt: PromptBlockHashes, alive: int) -> dict[int, int]:
        """For each worker bit in `alive` that holds the prompt's first block: how many leading
        blocks of the prompt it holds (bits holding none are left out).

        A worker's cache holds a prefix's blocks before its later ones: it frees a sequence's
        tail blocks first, and a block in use keeps every block before it in use. So the
        workers holding block k are among those holding block k - 1, and each worker's count
        is found by bisection over block counts: the first block, the last, then the middle of
        every range where the set of holders changes. A prompt held whole costs two probes; K
        distinct counts cost about K * log2(blocks). A hole in a worker's prefix that no probe
        lands on goes unseen, and the count runs past it (the worker then serves less than
        predicted).
        """
        num_blocks = len(prompt)
        if not alive or num_blocks == 0:
            return {}
        holders = self._holders
        hash_of = prompt.hash_of
        at_first = holders.get(hash_of(1), 0) & alive
        if not at_first:
            return {}
        at_last = holders.get(hash_of(num_blocks), 0) & at_first
        counts: dict[int, int] = {}  # bit -> blocks
        if at_last:
            _count(counts, at_last, num_blocks)
        # Ranges (lo, holders of block lo, hi, holders of block hi; sets as bits): the workers
        # of the first set outside the second hold lo blocks and fewer than hi. A worker with a
        # hole in its prefix may be counted in two ranges: the lower count is what it serves.
        ranges = [(1, at_first, num_blocks, at_last)]
        while ranges:
            lo, at_lo, hi, at_hi = ranges.pop()
            if at_lo == at_hi:  # at_hi is a subset of at_lo
                continue
            if hi - lo == 1:
                _count(counts, at_lo & ~at_hi, lo)
                continue
            mid = (lo + hi) // 2
            at_mid = holders.get(hash_of(mid), 0) & at_lo
            ranges.append((mid, at_mid, hi, at_hi & at_mid))
            ranges.append((lo, at_lo, mid, at_mid))
        return counts


def _is_being_cancelled() -> bool:
    """Whether someone called cancel() on the running task (Python 3.11+; False before)."""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    return cancelling is not None and cancelling() > 0


def _count(counts: dict[int, int], bits: int, num_blocks: int) -> None:
    """Records num_blocks for each worker bit in `bits`, unless one is lower already."""
    while bits:
        bit = bits & -bits
        if counts.get(bit, num_blocks) >= num_blocks:
            counts[bit] = num_blocks
        bits ^= bit


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
                # The pool replaces an unhealthy worker's channel and closes the old one (its
                # reconnect): take the current stub each time.
                channel = worker.channel
                try:
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
                except grpc.aio.UsageError:  # the channel closed before the call started
                    reason = "its channel was closed"
                except asyncio.CancelledError:
                    # Closing a channel cancels the calls on it, and the call raises
                    # CancelledError into this task. Only a cancel of the task itself ends it.
                    if worker.channel is channel or _is_being_cancelled():
                        raise
                    reason = "its channel was replaced"
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

"""Publishes a worker's prefix-cache keys to subscribers (SubscribeKVEvents): a snapshot of the
block hashes it holds, then the hashes stored and evicted since, and `cleared` when the whole
cache is dropped (ResetPrefixCache).

The block manager calls `stored`/`evicted` on the engine thread whenever a hash enters or
leaves its cache map, and `cleared` when every hash leaves at once. Each change gets a sequence
number there and is handed to the event loop in batches (one loop wake-up per batch, not per
block). A subscriber's queue is registered on the loop before its snapshot is taken on the
engine thread; the snapshot carries the number of the last change it includes, and the
subscriber skips every change up to that number. So the snapshot plus the later changes are
exactly the cache's state, whatever the interleaving.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import grpc

from tandem.common.logging import get_logger
from tandem.v1 import worker_pb2

logger = get_logger(__name__)
# Batches a subscriber may have unread before it is cut off (it reconnects to a snapshot).
MAX_UNREAD_BATCHES = 10_000
_CLOSED = object()  # queued to every subscriber when the worker shuts down
_OVERFLOWED = object()  # queued to a subscriber that fell too far behind


class KVEventPublisher:
    def __init__(self, engine, max_unread_batches: int = MAX_UNREAD_BATCHES) -> None:
        self.engine = engine  # an AsyncEngine
        self.max_unread_batches = max_unread_batches
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()  # guards the fields below it (engine thread vs loop)
        self._last_change = 0  # sequence number of the latest change
        # (number, hash, is_stored); hash None: the cache was cleared
        self._pending: list[tuple[int, int | None, bool]] = []
        self._is_flush_scheduled = False
        self._subscribers: set[asyncio.Queue] = set()  # touched only on the loop
        self._is_closed = False

    # -- engine thread (the block manager's cache listener) -------------------------------

    def stored(self, block_hash: int) -> None:
        self._push(block_hash, True)

    def evicted(self, block_hash: int) -> None:
        self._push(block_hash, False)

    def cleared(self) -> None:
        self._push(None, False)

    def _push(self, block_hash: int | None, is_stored: bool) -> None:
        with self._lock:
            self._last_change += 1
            self._pending.append((self._last_change, block_hash, is_stored))
            if self._is_flush_scheduled:
                return
            self._is_flush_scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed: the worker is exiting, nobody listens
            pass

    def last_change(self) -> int:
        """The latest change's number (AsyncEngine.watch_prefix_cache reads it with the
        snapshot it takes)."""
        with self._lock:
            return self._last_change

    # -- event loop ------------------------------------------------------------------------

    def _flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
            self._is_flush_scheduled = False
        for queue in list(self._subscribers):
            if queue.qsize() >= self.max_unread_batches:
                self._subscribers.discard(queue)
                queue.put_nowait(_OVERFLOWED)
            else:
                queue.put_nowait(batch)

    def close(self) -> None:
        """Ends every subscription (the worker is shutting down) and refuses new ones."""
        self._is_closed = True
        for queue in self._subscribers:
            queue.put_nowait(_CLOSED)
        self._subscribers.clear()

    async def subscribe(self, context) -> AsyncIterator[worker_pb2.SubscribeKVEventsResponse]:
        """The SubscribeKVEvents stream: a snapshot, then one message per batch of changes."""
        if self._is_closed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        self._loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            # From the first subscription on this publisher stays the cache's listener.
            snapshot = await self.engine.watch_prefix_cache(self)
            snapshot_change, block_size = snapshot.last_change, snapshot.block_size
            yield worker_pb2.SubscribeKVEventsResponse(is_snapshot=True, block_size=block_size,
                                                       stored_hashes=snapshot.block_hashes)
            while True:
                batches = [await queue.get()]
                while not queue.empty():  # coalesce whatever else is already queued
                    batches.append(queue.get_nowait())
                if _CLOSED in batches:
                    return
                if _OVERFLOWED in batches:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"subscriber fell {self.max_unread_batches} batches "
                                        "of KV events behind; subscribe again")
                latest: dict[int, bool] = {}  # hash -> held, as of the newest change
                is_cleared = False  # latest holds only the changes after the clear
                for batch in batches:
                    for number, block_hash, is_stored in batch:
                        if number <= snapshot_change:
                            continue
                        if block_hash is None:
                            latest.clear()
                            is_cleared = True
                        else:
                            latest[block_hash] = is_stored
                if latest or is_cleared:
                    yield worker_pb2.SubscribeKVEventsResponse(
                        block_size=block_size, cleared=is_cleared,
                        stored_hashes=[h for h, held in latest.items() if held],
                        evicted_hashes=[h for h, held in latest.items() if not held])
        finally:
            self._subscribers.discard(queue)

"""Admission control: at most max_concurrency requests on the workers, at most max_queue
waiting behind them; beyond that a request is refused with RESOURCE_EXHAUSTED at once, with
trailing metadata `retry-after-ms`: about when a queue place frees up (the mean time a request
holds its slot, times the queue's length over the slots), within [MIN_RETRY_AFTER_MS,
MAX_RETRY_AFTER_MS].

A request takes its place (`place()`) before anything else is done for it, so a refusal costs
no validation or tokenization, and requests still being tokenized count against the
capacity: max_concurrency + max_queue places in all. Holding a place it then waits for one of
the max_concurrency running slots (`slot()`).
"""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager, contextmanager

import grpc

from tandem.router.validation import RequestError

RETRY_AFTER_KEY = "retry-after-ms"
MIN_RETRY_AFTER_MS = 100
MAX_RETRY_AFTER_MS = 60_000
_HOLD_SMOOTHING = 0.1  # weight of the newest request in the mean slot-holding time


class AtCapacity(RequestError):
    """RESOURCE_EXHAUSTED from admission: every place in the router is taken."""


class Admission:
    def __init__(self, max_concurrency: int, max_queue: int) -> None:
        if max_concurrency < 1 or max_queue < 0:
            raise ValueError(f"max_concurrency={max_concurrency} must be >= 1 and "
                             f"max_queue={max_queue} >= 0")
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self._slots = asyncio.Semaphore(max_concurrency)
        self.num_placed = 0  # requests holding a place: preparing, waiting or running
        self.num_running = 0
        self.mean_hold_seconds = 1.0  # until requests have finished

    @property
    def num_waiting(self) -> int:
        """Requests in the router not yet on a worker (being prepared or queued)."""
        return self.num_placed - self.num_running

    @property
    def retry_after_ms(self) -> int:
        waves = (self.num_waiting + 1) / self.max_concurrency
        return int(min(max(self.mean_hold_seconds * waves * 1000, MIN_RETRY_AFTER_MS),
                       MAX_RETRY_AFTER_MS))

    @contextmanager
    def place(self):
        """A place in the router for one request, or RESOURCE_EXHAUSTED when all are taken."""
        if self.num_placed >= self.max_concurrency + self.max_queue:
            retry_after_ms = self.retry_after_ms
            raise AtCapacity(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"router is at capacity: {self.num_running} requests running, "
                             f"{self.num_waiting} queued (max_queue={self.max_queue}); "
                             f"retry after {retry_after_ms} ms",
                             ((RETRY_AFTER_KEY, str(retry_after_ms)),))
        self.num_placed += 1
        try:
            yield
        finally:
            self.num_placed -= 1

    @asynccontextmanager
    async def slot(self):
        """A running slot, waited for in the queue; only inside place()."""
        await self._slots.acquire()
        self.num_running += 1
        started = time.monotonic()
        try:
            yield
        finally:
            self.num_running -= 1
            self._slots.release()
            self.mean_hold_seconds += _HOLD_SMOOTHING * (time.monotonic() - started
                                                         - self.mean_hold_seconds)

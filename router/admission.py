"""Admission control: at most max_concurrency requests on the workers, at most max_queue
waiting behind them; beyond that a request is refused with RESOURCE_EXHAUSTED at once."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import grpc

from tandem.router.validation import RequestError


class Admission:
    def __init__(self, max_concurrency: int, max_queue: int) -> None:
        if max_concurrency < 1 or max_queue < 0:
            raise ValueError(f"max_concurrency={max_concurrency} must be >= 1 and "
                             f"max_queue={max_queue} >= 0")
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self._slots = asyncio.Semaphore(max_concurrency)
        self.num_waiting = 0
        self.num_running = 0

    @asynccontextmanager
    async def slot(self):
        if self._slots.locked() and self.num_waiting >= self.max_queue:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"router is at capacity: {self.num_running} requests running, "
                               f"{self.num_waiting} queued (max_queue={self.max_queue})")
        self.num_waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.num_waiting -= 1
        self.num_running += 1
        try:
            yield
        finally:
            self.num_running -= 1
            self._slots.release()

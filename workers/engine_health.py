"""Turns the worker's grpc.health.v1 status NOT_SERVING while its engine thread makes no
progress, and back to SERVING when it does.

Progress is a finished loop turn of the engine thread (a step, a batch of commands, an idle
wait), so a stall is one step or command running longer than `max_stall_seconds`, or a dead
thread. A step is bounded by chunked prefill (max_num_batched_tokens prompt tokens) or one
token per running sequence, so the limit must exceed the longest such step on the worker's
hardware; the check itself only reads a timestamp and never waits for the engine.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable

from grpc_health.v1 import health_pb2

from tandem.common.logging import get_logger
from tandem.workers.async_engine import AsyncEngine

logger = get_logger(__name__)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class EngineHealthWatch:
    def __init__(self, engine: AsyncEngine, health_servicer, service_names: Iterable[str],
                 max_stall_seconds: float) -> None:
        if max_stall_seconds <= 0:
            raise ValueError(f"max_stall_seconds={max_stall_seconds} must be > 0")
        self.engine = engine
        self.health = health_servicer  # a grpc_health.v1 health.aio.HealthServicer
        self.service_names = tuple(service_names)
        self.max_stall_seconds = max_stall_seconds
        # Checks a few times per limit, at most once a second (a stall is reported within
        # max_stall_seconds + the interval).
        self.interval_seconds = min(1.0, max_stall_seconds / 4)
        self.is_serving = True
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-health-watch")

    async def stop(self) -> None:
        """Stop watching (before the server's graceful shutdown sets NOT_SERVING for good)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.interval_seconds)

    async def check(self) -> None:
        stalled_for = self.engine.seconds_without_progress()
        is_stalled = stalled_for > self.max_stall_seconds
        if is_stalled == (not self.is_serving):
            return
        self.is_serving = not is_stalled
        if is_stalled:
            logger.error("engine made no progress for %.0f s (--max-step-stall-seconds %g): "
                         "health NOT_SERVING", stalled_for, self.max_stall_seconds)
        else:
            logger.warning("engine progresses again: health SERVING")
        status = SERVING if self.is_serving else NOT_SERVING
        for name in self.service_names:
            await self.health.set(name, status)

"""The asyncio load driver: sends RequestSpecs over one AsyncTandemClient and records each.

Closed loop (`concurrency` N): N tasks each send a request, await its whole stream, and send the
next. Open loop (`rate` R): one task sends requests at Poisson arrivals (exponential gaps of
mean 1/R, from a generator seeded apart from the workload's, so a sweep sends the same prompts
at every rate) without waiting for earlier ones. Either way the first `warmup` requests go out
first and are marked is_warmup; the measured requests follow without a pause, and `duration_s`
counts from the first of them. Once the limit is reached no request starts; those in flight
finish.
"""
from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Iterator

import grpc
import numpy as np

from tandem.bench.config import BenchmarkConfig
from tandem.bench.records import RequestRecord
from tandem.bench.workload import RequestSpec
from tandem.client import AsyncTandemClient

__all__ = ["LoadGenerator", "Progress"]


class Progress:
    """One stderr status line: redrawn in place on a terminal, else printed every 10 s."""

    def __init__(self, *, label: str, total: int | None, duration_s: float | None,
                 enabled: bool, stream=None) -> None:
        self.label, self.total, self.duration_s = label, total, duration_s
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = self.enabled and self.stream.isatty()
        self.started_at = time.perf_counter()
        self._drawn_at = float("-inf")
        self._has_drawn = False

    def update(self, *, num_done: int, num_in_flight: int, num_errors: int,
               force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self._drawn_at < (0.1 if self.is_tty else 10)):
            return
        self._drawn_at, elapsed = now, now - self.started_at
        done = f"{num_done}/{self.total}" if self.total is not None else f"{num_done}"
        bar = ""
        if self.total:
            filled = int(20 * min(1.0, num_done / self.total))
            bar = "[" + "#" * filled + "." * (20 - filled) + "] "
        clock = f"{elapsed:.1f}" + (f"/{self.duration_s:g}" if self.duration_s else "") + " s"
        line = (f"bench ({self.label}) {bar}{done} done, {num_in_flight} in flight, "
                f"{num_errors} errors, {clock}")
        self.stream.write(f"\r\033[K{line}" if self.is_tty else line + "\n")
        self.stream.flush()
        self._has_drawn = True

    def close(self) -> None:
        if self.is_tty and self._has_drawn:
            self.stream.write("\n")
            self.stream.flush()


class LoadGenerator:
    """Runs one load phase (warmup + measured requests) and returns its records."""

    def __init__(self, client: AsyncTandemClient, config: BenchmarkConfig,
                 specs: Iterator[RequestSpec], arrival_stream: int = 0) -> None:
        """arrival_stream: which of several processes' independent Poisson arrivals this one
        draws (bench/spread.py); 0 is a single process's."""
        self.client, self.config, self.specs = client, config, specs
        self.records: list[RequestRecord] = []
        self._next_index = 0
        self._num_in_flight = 0
        self._num_errors = 0
        self._measured_start_s: float | None = None
        self._run_id = uuid.uuid4().hex[:8]
        self._arrivals = np.random.default_rng(
            [config.seed, 1] + ([arrival_stream] if arrival_stream else []))
        limit = config.max_measured_requests
        self.progress = Progress(label=config.load_shape(),
                                 total=None if limit is None else config.warmup + limit,
                                 duration_s=config.duration_s, enabled=config.show_progress)

    async def run(self) -> list[RequestRecord]:
        """Sends every request, waits for all of them; records sorted by index."""
        try:
            if self.config.is_open_loop:
                await self._run_open_loop()
            else:
                await asyncio.gather(*(self._closed_loop_worker()
                                       for _ in range(self.config.max_in_flight)))
        finally:
            self._draw_progress(force=True)
            self.progress.close()
        return sorted(self.records, key=lambda record: record.index)

    def _can_issue(self) -> bool:
        limit = self.config.max_measured_requests
        if limit is not None and self._next_index >= self.config.warmup + limit:
            return False
        if self.config.duration_s is None or self._measured_start_s is None:
            return True
        return time.perf_counter() - self._measured_start_s < self.config.duration_s

    def _take(self) -> tuple[int, RequestSpec]:
        index, self._next_index = self._next_index, self._next_index + 1
        if index == self.config.warmup:
            self._measured_start_s = time.perf_counter()
        return index, next(self.specs)

    async def _closed_loop_worker(self) -> None:
        while self._can_issue():
            await self._send(*self._take())

    async def _run_open_loop(self) -> None:
        tasks: set[asyncio.Task] = set()
        next_at = time.perf_counter()
        while self._can_issue():
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
                if not self._can_issue():
                    break
            task = asyncio.create_task(self._send(*self._take()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            next_at += self._arrivals.exponential(1.0 / self.config.rate)
        if tasks:
            await asyncio.gather(*tasks)

    async def _send(self, index: int, spec: RequestSpec) -> None:
        config = self.config
        record = RequestRecord(index=index, start_s=time.perf_counter(),
                               is_warmup=index < config.warmup, max_tokens=spec.max_tokens,
                               num_prompt_tokens=spec.num_prompt_tokens,
                               ideal_cached_tokens=spec.ideal_cached_tokens)
        prompt = list(spec.token_ids) if spec.token_ids is not None else spec.text
        messages = list(spec.messages) if spec.messages is not None else None
        seed = (config.seed + index) % 2**64 if config.temperature > 0 else None
        self._num_in_flight += 1
        try:
            stream = self.client.stream(
                prompt, messages=messages, timeout=config.timeout_s,
                request_id=f"bench-{self._run_id}-{index}", max_tokens=spec.max_tokens,
                min_tokens=None if config.allow_early_stop else spec.max_tokens,
                temperature=config.temperature, seed=seed)
            async with stream:
                async for delta in stream:
                    record.add_chunk(time.perf_counter(), len(delta.token_ids))
            record.finish_reason = stream.result.finish_reason
            record.num_prompt_tokens = stream.result.usage["prompt_tokens"]
            record.router_timings = stream.result.timings
            record.num_cached_prompt_tokens = stream.result.usage.get("cached_prompt_tokens")
            if spec.on_done is not None:
                spec.on_done(stream.result.token_ids)
        except grpc.RpcError as exc:
            record.error_code, record.error_message = exc.code().name, exc.details() or ""
        except RuntimeError as exc:  # the stream ended without its Complete message
            record.error_code, record.error_message = "INCOMPLETE_STREAM", str(exc)
        except asyncio.CancelledError:  # the run was interrupted
            record.error_code = "CANCELLED"
            raise
        finally:
            record.end_s = time.perf_counter()
            self._num_in_flight -= 1
            self._num_errors += record.error_code is not None
            self.records.append(record)
            self._draw_progress()

    def _draw_progress(self, force: bool = False) -> None:
        self.progress.update(num_done=len(self.records), num_in_flight=self._num_in_flight,
                             num_errors=self._num_errors, force=force)

"""Runs an LLMEngine on its own thread and connects it to asyncio code.

The event loop never runs model code. asyncio code talks to the engine thread two ways:
  * `await call(fn)`: run fn(engine) on the engine thread between two steps (adding, aborting,
    releasing requests; reading state). Commands are the only way engine state is touched.
  * `open_stream(request_id)`: an asyncio.Queue that receives a TokenEvent for each token of
    that request, in order; the last one has finish_reason set (or is_pinned on a prefill).
    A request prefilled elsewhere (LLMEngine.queue_prefilled) first receives BlocksReserved
    once the engine has allocated the blocks its KV is to be written into.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tandem.common.logging import get_logger
from tandem.workers.engine.engine import LLMEngine
from tandem.workers.engine.sequence import (FinishReason, Sequence, SequenceStatus,
                                            TokenLogprob)

logger = get_logger(__name__)
T = TypeVar("T")
# The longest an idle engine thread sleeps: a command wakes it at once, and it wakes when the
# next pinned KV lease is due.
MAX_IDLE_WAIT_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_id: int
    logprob: TokenLogprob | None
    finish_reason: FinishReason | None  # set on the request's last token
    is_pinned: bool  # prefill requests: the prompt's KV is pinned for a decode worker
    num_cached_tokens: int
    queue_seconds: float  # arrival -> first scheduled
    compute_seconds: float  # first scheduled -> this token
    # Pinned prefills: the prompt's blocks and the pin's deadline (time.monotonic()), as the
    # engine set them when pinning; a KV handle names them (cuda-ipc needs no lease round trip).
    kv_blocks: tuple[int, ...] = ()
    lease_deadline: float = 0.0


@dataclass(frozen=True, slots=True)
class BlocksReserved:
    """A request prefilled elsewhere holds its blocks now (RECEIVING): its KV may be pulled."""


@dataclass(frozen=True, slots=True)
class EngineFailure:
    """Delivered to every open stream when a step raised: the requests are gone."""

    message: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine,
                 on_step: Callable[[list[Sequence] | None], None] | None = None) -> None:
        self.engine = engine
        # Called on the engine thread after every step with the sequences that got a token,
        # and with None on idle wake-ups (metrics).
        self._on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}  # touched only on the event loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # time.monotonic() when the engine thread last finished a loop turn (a step, a batch
        # of commands, or an idle wait); a plain float, written by that thread only.
        self._last_beat = time.monotonic()
        self._is_idle = False  # the engine thread is waiting for a command: no work to stall

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping.set()
        self._commands.put(None)  # wake the thread
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """fn(engine) on the engine thread. Cancelling the caller before the engine thread
        takes fn drops it: use `call_shielded` or `submit` for what must happen."""
        return await asyncio.wrap_future(self.submit(fn))

    async def call_shielded(self, fn: Callable[[LLMEngine], T]) -> T:
        """Like call, but fn runs even if the caller is cancelled while waiting (the caller
        then gets CancelledError and the result is dropped)."""
        return await asyncio.shield(asyncio.wrap_future(self.submit(fn)))

    @property
    def kv_lease_seconds(self) -> float:
        """How long a pinned prompt's KV stays pinned after each renewal (configuration)."""
        return self.engine.config.kv_lease_seconds

    async def renew_kv_lease(self, handle_id: str) -> list[int] | None:
        """LLMEngine.renew_lease on the engine thread: the pinned prompt's block ids, or None
        when the handle is unknown or its lease expired."""
        return await self.call(lambda e: e.renew_lease(handle_id))

    async def release_kv(self, handle_id: str) -> bool:
        """Unpins a handed-off prompt's blocks (LLMEngine.release); False when not pinned."""
        return await self.call(lambda e: e.release(handle_id))

    async def run_kv_ops(self, ops: list) -> list:
        """KV rank ops (kv/rank_ops.py) on every rank of the executor, on the engine thread
        between two steps; rank 0's answer to each."""
        return await self.call(lambda e: e.executor.run_kv_ops(ops))

    def submit_kv_ops(self, ops: list) -> concurrent.futures.Future:
        """run_kv_ops for a caller that cannot await (a cancelled transfer's clean-up): queued
        now, after every command queued before, and never dropped."""
        return self.submit(lambda e: e.executor.run_kv_ops(ops))

    def seconds_without_progress(self) -> float:
        """Seconds since the engine thread last finished a step, a batch of commands or an
        idle wait: it stays small while the engine works or idles, and grows only while one
        step or command runs (or the thread is stuck). Infinite once the thread has died."""
        if self._thread is not None and not self._thread.is_alive() \
                and not self._stopping.is_set():
            return math.inf
        if self._is_idle:
            return 0.0
        return time.monotonic() - self._last_beat

    def submit(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future:
        """Queues fn for the engine thread now (commands run in the order queued), for a
        caller that cannot await: a cancelled coroutine's clean-up. Nothing on the event
        loop can cancel the returned future, so fn always runs."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        return future

    def open_stream(self, request_id: str) -> asyncio.Queue:
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # -- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            self._last_beat = time.monotonic()
            self._run_commands(block=not engine.has_unfinished)
            self._last_beat = time.monotonic()
            expired = engine.expire_leases(time.monotonic())
            if expired:
                logger.warning("freed %d pinned KV handle(s) nobody pulled: %s", len(expired),
                               ", ".join(expired))
            reserved = engine.reserve_remote()  # blocks freed since the last turn
            if reserved:
                self._loop.call_soon_threadsafe(
                    self._dispatch, [(seq.request_id, BlocksReserved()) for seq in reserved])
            if not engine.has_unfinished:
                self._notify(None)
                continue
            try:
                updated = engine.step()
            except Exception as exc:  # a failed step must not leave streams hanging
                logger.exception("engine step failed; aborting all requests")
                self._fail_all(f"engine step failed: {exc}")
                continue
            if updated:
                events = [(seq.request_id, _event(seq, engine.pinned)) for seq in updated]
                self._loop.call_soon_threadsafe(self._dispatch, events)
            self._notify(updated)

    def _notify(self, updated: list[Sequence] | None) -> None:
        if self._on_step is None:
            return
        try:
            self._on_step(updated)
        except Exception:  # metrics must never stop the engine
            logger.exception("step observer failed")

    def _run_commands(self, block: bool) -> None:
        try:
            if block:
                self._is_idle = True
                try:
                    item = self._commands.get(timeout=self._idle_wait())
                finally:
                    self._is_idle = False
                    self._last_beat = time.monotonic()
            else:
                item = self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:  # delivered to the awaiting coroutine
                    future.set_exception(exc)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _idle_wait(self) -> float:
        """Seconds until the first pinned lease is due, at most MAX_IDLE_WAIT_SECONDS."""
        if not self.engine.pinned:
            return MAX_IDLE_WAIT_SECONDS
        due_in = min(self.engine.pinned.values()) - time.monotonic()
        return min(MAX_IDLE_WAIT_SECONDS, max(0.0, due_in))

    def _fail_all(self, message: str) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        self._loop.call_soon_threadsafe(self._broadcast, EngineFailure(message))

    # -- event loop ------------------------------------------------------------------------

    def _dispatch(self, events: list[tuple[str, TokenEvent]]) -> None:
        for request_id, event in events:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(event)

    def _broadcast(self, failure: EngineFailure) -> None:
        for stream in self._streams.values():
            stream.put_nowait(failure)


def _event(seq: Sequence, pinned: dict[str, float]) -> TokenEvent:
    now = time.monotonic()
    is_pinned = seq.status is SequenceStatus.PINNED
    scheduled = seq.first_scheduled_time or seq.arrival_time
    return TokenEvent(
        token_id=seq.last_known_token_id,
        logprob=seq.logprobs[-1] if seq.sampling_params.logprobs is not None and seq.logprobs
        else None,
        finish_reason=seq.finish_reason if seq.status is SequenceStatus.FINISHED else None,
        is_pinned=is_pinned,
        num_cached_tokens=seq.num_prefix_hit_tokens,
        queue_seconds=scheduled - seq.arrival_time,
        compute_seconds=now - scheduled,
        kv_blocks=tuple(seq.block_table) if is_pinned else (),
        lease_deadline=pinned.get(seq.request_id, 0.0) if is_pinned else 0.0)

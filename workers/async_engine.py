"""Runs an LLMEngine on its own thread and connects it to asyncio code.

The event loop never runs model code. asyncio code talks to the engine thread two ways:
  * typed commands (`add_request`, `abort`, `queue_prefilled`, `reset_prefix_cache`, ...):
    each runs on the engine thread between two steps, in the order queued. Commands are the
    only way engine state is touched. `call(fn)`, which runs any fn(engine) there, is
    internal: the typed commands and kv/rank_transfers.py use it.
  * `load`: the engine's load (EngineLoad), published by the engine thread after every command,
    lease expiry, reservation and step, before any of their results reach the event loop: a
    caller that has seen a result reads a load that includes it, without a command.
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
from typing import Protocol, TypeVar

from tandem.common.logging import get_logger
from tandem.common.sampling_params import SamplingParams
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


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What GetLoad reports, as of the engine thread's latest published turn."""

    num_running: int
    num_waiting: int  # queued for scheduling, grammar compiles included
    kv_usage: float  # fraction of KV blocks held by live sequences
    num_free_blocks: int
    num_pinned: int  # prefilled prompts whose KV waits for a decode worker

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineLoad:
        """Read on the engine thread (between two steps, or in a command)."""
        scheduler, manager = engine.scheduler, engine.block_manager
        return cls(num_running=len(scheduler.running),
                   num_waiting=len(scheduler.waiting) + len(engine.awaiting_grammar),
                   kv_usage=manager.usage, num_free_blocks=manager.num_free_blocks,
                   num_pinned=len(engine.pinned))


class PrefixCacheListener(Protocol):
    """Told, on the engine thread, of every change to the prefix cache's keys (the block
    manager's cache listener); numbers the changes it has been told of."""

    def stored(self, block_hash: int) -> None: ...

    def evicted(self, block_hash: int) -> None: ...

    def cleared(self) -> None: ...

    def last_change(self) -> int:
        """The number of the latest change it was told of."""
        ...


@dataclass(frozen=True, slots=True)
class PrefixCacheSnapshot:
    """The prefix cache's keys between two steps: exactly the changes the listener numbered
    up to last_change are in block_hashes, none after."""

    block_hashes: list[int]
    block_size: int
    last_change: int


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
        # Replaced (never mutated) by the engine thread; read anywhere.
        self._load = EngineLoad.of(engine)

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
        takes fn drops it: use `call_shielded` or `submit` for what must happen.

        Internal: the typed commands below are built on it, and kv/rank_transfers.py posts
        its transfer steps through it; every other caller uses a typed command
        (tests/unit/test_import_layers.py holds workers/ to that)."""
        return await asyncio.wrap_future(self.submit(fn))

    async def call_shielded(self, fn: Callable[[LLMEngine], T]) -> T:
        """Like call, but fn runs even if the caller is cancelled while waiting (the caller
        then gets CancelledError and the result is dropped)."""
        return await asyncio.shield(asyncio.wrap_future(self.submit(fn)))

    # -- typed commands: each runs on the engine thread between two steps -------------------
    # A command awaited by a caller that is cancelled before the engine thread takes it is
    # dropped (as `call`), except where its docstring says otherwise.

    async def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                          request_id: str, *, pin_after_prefill: bool = False,
                          deadline: float | None = None) -> Sequence:
        """Queues a new request (LLMEngine.add_request); its sequence. Raises ValueError (an
        empty prompt, a grammar known not to compile), OutOfRangeError (no room under
        max_model_len, a token outside the vocabulary) or AlreadyExistsError (the id is
        live)."""
        return await self.call(lambda e: e.add_request(
            prompt_token_ids, params, request_id, pin_after_prefill=pin_after_prefill,
            deadline=deadline))

    async def resume_request(self, prompt_token_ids: list[int],
                             generated_token_ids: list[int], params: SamplingParams,
                             request_id: str, *, deadline: float | None = None) -> Sequence:
        """Queues a request that another worker started (LLMEngine.resume_request): its
        sequence, which computes the prompt and the generated tokens here. Raises as
        add_request, and OutOfRangeError when the generated tokens reach max_tokens."""
        return await self.call(lambda e: e.resume_request(
            prompt_token_ids, generated_token_ids, params, request_id, deadline=deadline))

    async def abort_and_resume(self, prompt_token_ids: list[int],
                               generated_token_ids: list[int], params: SamplingParams,
                               request_id: str, *, deadline: float | None = None) -> Sequence:
        """Aborts the request (freeing whatever blocks it holds) and resumes it under the same
        id in one command, so no step runs between the two: the new sequence, as
        resume_request returns it, raising as it does. For a prefilled request whose KV could
        not be pulled: its prompt is then computed here."""
        def abort_then_resume(engine: LLMEngine) -> Sequence:
            engine.abort(request_id)
            return engine.resume_request(prompt_token_ids, generated_token_ids, params,
                                         request_id, deadline=deadline)
        return await self.call(abort_then_resume)

    async def abort(self, request_id: str) -> bool:
        """Stops the request wherever it is and frees its blocks (LLMEngine.abort); False when
        it is unknown or already finished. The abort runs even if the caller is cancelled
        while waiting (the caller then gets CancelledError)."""
        return await self.call_shielded(lambda e: e.abort(request_id))

    def abort_soon(self, request_id: str) -> concurrent.futures.Future:
        """Queues the request's abort now, after every command queued before it (such as its
        add), for a caller that must not await: a cancelled handler's clean-up. Nothing can
        drop it; the future answers as `abort` does."""
        return self.submit(lambda e: e.abort(request_id))

    async def queue_prefilled(self, prompt_token_ids: list[int],
                              generated_token_ids: list[int], params: SamplingParams,
                              request_id: str, *, deadline: float | None = None) -> Sequence:
        """Queues a request prefilled elsewhere for blocks to receive its KV into
        (LLMEngine.queue_prefilled): its sequence, WAITING_FOR_REMOTE_KVS; its stream gets
        BlocksReserved once they are allocated. Raises ValueError (no generated token, an
        empty prompt, a grammar known not to compile), OutOfRangeError or
        AlreadyExistsError as add_request does."""
        return await self.call(lambda e: e.queue_prefilled(
            prompt_token_ids, generated_token_ids, params, request_id, deadline=deadline))

    async def activate_prefilled(self, seq: Sequence, num_computed_tokens: int) -> None:
        """The KV of seq's first num_computed_tokens tokens is in its blocks: it starts
        decoding (LLMEngine.activate_prefilled). Raises RuntimeError when seq is not
        RECEIVING (aborted meanwhile) and ValueError when num_computed_tokens is outside
        [seq.num_cached_tokens, seq.num_tokens)."""
        await self.call(lambda e: e.activate_prefilled(seq, num_computed_tokens))

    async def reset_prefix_cache(self) -> int:
        """Forgets every cached block (BlockManager.reset_prefix_cache); how many it forgot.
        Live sequences keep their blocks; the cache listener, if any, is told `cleared`."""
        return await self.call(lambda e: e.block_manager.reset_prefix_cache())

    async def watch_prefix_cache(self, listener: PrefixCacheListener) -> PrefixCacheSnapshot:
        """Installs listener as the block manager's cache listener (it stays installed, and
        replaces any other) and, in the same command, takes the keys the cache holds with
        listener.last_change(): the snapshot plus the changes numbered after it are the
        cache's state from then on."""
        def snapshot(engine: LLMEngine) -> PrefixCacheSnapshot:
            manager = engine.block_manager
            manager.cache_listener = listener
            return PrefixCacheSnapshot(list(manager.hash_to_block_id), manager.block_size,
                                       listener.last_change())
        return await self.call(snapshot)

    @property
    def load(self) -> EngineLoad:
        """The latest published load: it includes every command whose result, and every
        token or BlocksReserved event that, the event loop has received."""
        return self._load

    def holds_request(self, request_id: str) -> bool:
        """Whether the engine holds the request now (queued, running, pinned or receiving
        KV). One dict lookup from any thread: no command, no wait for a step."""
        return request_id in self.engine.requests

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
            self._publish_load()
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
            self._publish_load()
            if updated:
                events = [(seq.request_id, _event(seq, engine.pinned)) for seq in updated]
                self._loop.call_soon_threadsafe(self._dispatch, events)
            self._notify(updated)

    def _publish_load(self) -> None:
        self._load = EngineLoad.of(self.engine)

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
                    result = fn(self.engine)
                except BaseException as exc:  # delivered to the awaiting coroutine
                    self._publish_load()
                    future.set_exception(exc)
                else:
                    self._publish_load()
                    future.set_result(result)
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
        self._publish_load()
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

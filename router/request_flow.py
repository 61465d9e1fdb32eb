"""One request's trip through the workers: prefill on P, decode on D (or both on one
aggregated worker), relaying tokens to the client as chunks.

Workers know the request by a worker-side id, unique per call and per attempt (migration.py),
never by the client's id: two calls with one client id cannot touch each other's work.
Whatever ends the call early (client cancel, deadline, a stop string, a worker failure), every
worker the request reached gets an explicit Abort: closing a stream alone is not relied on.

A worker that fails mid-request (an RPC error, a lost connection, a stream that ends early, or
a stall: no first token within `StallLimits.first_token_timeout`, no next token within
`max_token_gap_seconds`) raises WorkerFailure; a failure that is not the request's own fault
also ejects it from the pool. The request then migrates, up to `migration_limit` times: with
no token streamed yet it starts over (prefill on another prefill worker, or on an aggregated
one); otherwise another decode (or both) worker gets the prompt plus every token streamed so
far, computes their KV itself and continues, so the client sees one unbroken stream (the
worker counts those tokens as output: a seeded request's random stream goes on unchanged).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Collection
from contextlib import aclosing
from dataclasses import dataclass

import grpc

from tandem.common.convert import (engine_params_to_proto, finish_reason_from_proto,
                                   finish_reason_to_proto)
from tandem.common.logging import get_logger
from tandem.common.metrics import RouterMetrics
from tandem.common.sampling_params import SamplingParams
from tandem.router.decode_streams import DecodeReceiver, WorkerStatusError
from tandem.router.migration import Attempt, MigrationLog
from tandem.router.output import OutputAssembler
from tandem.router.routing_policy import RoutingNote
from tandem.router.validation import RequestError
from tandem.router.worker_pool import WorkerEndpoint, WorkerPool
from tandem.v1 import generate_pb2, worker_pb2

logger = get_logger(__name__)
ABORT_TIMEOUT_SECONDS = 2.0
_PASSED_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                   grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                   grpc.StatusCode.FAILED_PRECONDITION}
_background: set[asyncio.Task] = set()  # keeps fire-and-forget aborts alive


@dataclass(frozen=True, slots=True)
class StallLimits:
    """When a worker that stops producing counts as failed (router flags); 0 turns one off."""

    max_token_gap_seconds: float = 30.0  # --stall-timeout-seconds
    first_token_seconds: float = 120.0  # --first-token-timeout-seconds
    first_token_seconds_per_1k_tokens: float = 60.0  # --first-token-timeout-per-1k-tokens

    def __post_init__(self) -> None:
        for name in ("max_token_gap_seconds", "first_token_seconds",
                     "first_token_seconds_per_1k_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"StallLimits.{name}={getattr(self, name)} must be >= 0")

    def first_token_timeout(self, num_prompt_tokens: int) -> float | None:
        if not self.first_token_seconds:
            return None
        return (self.first_token_seconds
                + self.first_token_seconds_per_1k_tokens * num_prompt_tokens / 1000)

    @property
    def token_gap_timeout(self) -> float | None:
        return self.max_token_gap_seconds or None


class WorkerFailure(RequestError):
    """A worker failed or stalled during the request (and was ejected, unless the failure
    looked like the request's own: an INTERNAL error, say). `cause` labels the migration
    metric: stall, unavailable (connection lost, worker gone), stream_ended, error."""

    def __init__(self, worker: WorkerEndpoint, cause: str, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)
        self.worker = worker
        self.cause = cause


@dataclass
class RequestContext:
    request_id: str  # the client's (or one the router made up): logs and Complete only
    worker_request_id: str  # unique per call: what workers know the request by
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_strings: list[str]
    arrival: float
    queue_seconds: float


class RequestFlow:
    def __init__(self, pool: WorkerPool, tokenizer, request: RequestContext, context,
                 metrics: RouterMetrics, stall: StallLimits = StallLimits(),
                 migration_limit: int = 3) -> None:
        self.pool = pool
        self.stall = stall
        self.metrics = metrics
        self.request = request
        self.context = context
        self.output = OutputAssembler(tokenizer, request.prompt_token_ids, request.stop_strings)
        self.migrations = MigrationLog(request.worker_request_id, migration_limit)
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_cached_tokens = 0
        self.routing_note = RoutingNote()  # the policy's prediction for the prompt worker
        self.prefill_queue_seconds = 0.0
        self.prefill_compute_seconds = 0.0

    async def responses(self) -> AsyncIterator[generate_pb2.GenerateResponse]:
        is_done_on_workers = False
        try:
            finish_reason = None
            async with aclosing(self._migrating()) as stream:
                async for token_ids, logprobs, finish_reason in stream:
                    chunk = self._add(token_ids, logprobs)
                    if chunk is not None:
                        yield generate_pb2.GenerateResponse(chunk=chunk)
                    if self.output.matched_stop is not None:
                        finish_reason = "stop"
                        break
                else:
                    is_done_on_workers = True
            tail = self.output.finish()
            if tail is not None:
                yield generate_pb2.GenerateResponse(chunk=tail)
            if self.output.matched_stop is not None:  # also found in the held-back text
                finish_reason = "stop"
            yield generate_pb2.GenerateResponse(complete=self._complete(finish_reason))
        finally:
            if not is_done_on_workers:
                self._abort(self.migrations.current)

    async def _migrating(self):
        """(token_ids, logprobs, finish_reason) until the request finishes, moving it to
        another worker each time one fails (up to the migration limit)."""
        while True:
            try:
                stream = self._continued() if self.output.token_ids else self._started()
                async with aclosing(stream):
                    async for item in stream:
                        yield item
                return
            except WorkerFailure as failure:
                self.pool.note_abandoned(failure.worker, self.migrations.current.request_id)
                self._abort(self.migrations.record_failure(failure.worker.process_key,
                                                          failure.message))
                self.metrics.request_migrations.labels(cause=failure.cause).inc()
                logger.warning("request %s: %s; migrating it after %d streamed tokens "
                               "(migration %d of at most %d)", self.request.request_id,
                               failure.message, len(self.output.token_ids),
                               self.migrations.num_migrations,
                               self.migrations.migration_limit)

    def _started(self):
        """The request from its prompt: disaggregated when a prefill and a decode worker are
        available (not failed for this request), unless the routing policy has a decode worker
        that holds nearly all of the prompt prefill it itself (routing_policy.py, local
        prefill); else on an aggregated worker."""
        if self._candidates("prefill") and self._candidates("decode"):
            local = self._pick_local_prefill()
            if local is not None:
                return self._on_one_worker(local)
            return self._disaggregated()
        if self._candidates("both"):
            return self._aggregated()
        raise self._no_worker("need a prefill and a decode worker, or an aggregated (both) "
                              "worker")

    def _add(self, token_ids: list[int], logprobs) -> generate_pb2.Chunk | None:
        now = time.monotonic()
        if token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
                self._observe_first_token(now - self.request.arrival)
            else:
                # Tokens that arrive together: the first carries the gap, the others 0.
                self.metrics.inter_token_latency.observe(now - self.last_token_time)
                for _ in token_ids[1:]:
                    self.metrics.inter_token_latency.observe(0.0)
            self.last_token_time = now
            self.metrics.generation_tokens.inc(len(token_ids))
        return self.output.add(token_ids, logprobs)

    def _observe_first_token(self, ttft: float) -> None:
        """TTFT and its parts; the delivery part is the remainder, so the parts add up."""
        m = self.metrics
        m.time_to_first_token.observe(ttft)
        parts = {"router_queue": self.request.queue_seconds,
                 "prefill_queue": self.prefill_queue_seconds,
                 "prefill_compute": self.prefill_compute_seconds}
        parts["first_token_delivery"] = max(0.0, ttft - sum(parts.values()))
        for part, seconds in parts.items():
            m.ttft_part.labels(part=part).observe(seconds)

    async def _disaggregated(self):
        attempt = self.migrations.current
        prefill = self._pick(attempt, "prefill")
        params = engine_params_to_proto(self.request.params)
        prefill.num_in_flight += 1
        try:
            reply = await self._call(prefill, prefill.stub.Prefill(worker_pb2.PrefillRequest(
                request_id=attempt.request_id,
                prompt_token_ids=self.request.prompt_token_ids, params=params, keep_kv=True),
                timeout=self.context.time_remaining()), self._first_token_timeout(),
                "the first token")
        finally:
            prefill.num_in_flight -= 1
        self.num_cached_tokens = reply.num_cached_tokens
        self.prefill_queue_seconds = reply.queue_seconds
        self.prefill_compute_seconds = reply.compute_seconds
        finish = finish_reason_from_proto(reply.finish_reason)
        yield [reply.token_id], [reply.logprob] if reply.HasField("logprob") else [], finish
        if finish is not None:
            return
        request = worker_pb2.DecodeRequest(
            request_id=attempt.request_id, prompt_token_ids=self.request.prompt_token_ids,
            generated_token_ids=[reply.token_id], params=params, kv_handle=reply.kv_handle)
        # A decode worker without free blocks for the prompt refuses RESOURCE_EXHAUSTED before
        # its first message; each other healthy decode worker gets one try (the refusing one
        # is not failed, so it stays in the pool). The prefill worker's pin lasts meanwhile
        # (a waiting decode worker renews its lease) and is released by the decode worker
        # that pulls it, or by the Abort the prefill worker gets when the request ends here.
        refused: set[tuple[str, str]] = set()
        while True:
            decode = self._pick(attempt, "decode", exclude=refused)
            call = self._start_decode(decode, request)
            num_relayed = 0
            try:
                async with aclosing(self._relay(decode, call,
                                                self._first_token_timeout())) as relay:
                    async for item in relay:
                        num_relayed += 1
                        yield item
                return
            except RequestError as error:
                if (error.code != grpc.StatusCode.RESOURCE_EXHAUSTED or num_relayed
                        or not self._candidates("decode", exclude=refused | {
                            decode.process_key})):
                    raise
                refused.add(decode.process_key)
                self.metrics.decode_refusals.labels(worker=decode.address).inc()
                logger.info("request %s: decode worker %s refused it (%s); trying another "
                            "decode worker", self.request.request_id, decode.address,
                            error.message)

    async def _aggregated(self):
        async with aclosing(self._on_one_worker(self._pick(self.migrations.current,
                                                           "both"))) as stream:
            async for item in stream:
                yield item

    async def _on_one_worker(self, worker: WorkerEndpoint):
        """The whole request on one worker: an aggregated one, or a decode worker that
        prefills it itself (local prefill); its first message reports the prompt's cached
        tokens."""
        attempt = self.migrations.current
        call = self._start_decode(worker, worker_pb2.DecodeRequest(
            request_id=attempt.request_id, prompt_token_ids=self.request.prompt_token_ids,
            params=engine_params_to_proto(self.request.params)))
        async with aclosing(self._relay(worker, call, self._first_token_timeout(),
                                        is_prompt_worker=True)) as relay:
            async for item in relay:
                yield item

    async def _continued(self):
        """The request after a failure mid-stream: a decode (or both) worker computes the KV
        of the prompt and of every token streamed so far, then generates the rest."""
        generated = list(self.output.token_ids)
        if len(generated) >= self.request.params.max_tokens:
            yield [], [], "length"  # the failed worker died before saying it was done
            return
        attempt = self.migrations.current
        worker = self._pick(attempt, "decode", "both")
        call = self._start_decode(worker, worker_pb2.DecodeRequest(
            request_id=attempt.request_id, prompt_token_ids=self.request.prompt_token_ids,
            generated_token_ids=generated,
            params=engine_params_to_proto(self.request.params)))
        first_token_timeout = self.stall.first_token_timeout(
            len(self.request.prompt_token_ids) + len(generated))
        async with aclosing(self._relay(worker, call, first_token_timeout)) as relay:
            async for item in relay:
                yield item

    def _start_decode(self, worker: WorkerEndpoint,
                      request: worker_pb2.DecodeRequest) -> DecodeReceiver:
        remaining = self.context.time_remaining()
        return worker.decode_stream.start(
            worker.stub, request, None if remaining is None else max(remaining, 1e-3))

    async def _relay(self, worker: WorkerEndpoint, receiver: DecodeReceiver,
                     first_token_timeout: float | None, is_prompt_worker: bool = False):
        """(token_ids, logprobs, finish_reason) per read of the request's decode updates:
        the tokens of every message that arrived since the previous read. is_prompt_worker:
        the worker computes the prompt (no KV pulled): its cached tokens are the request's."""
        worker.num_in_flight += 1
        # Its first message follows the KV pull or the whole prompt: the first-token allowance;
        # every later one a single decode step.
        watchdog = StallWatchdog(first_token_timeout)
        try:
            awaited = "a message"
            while True:
                messages = await self._call(worker, watchdog.read(receiver), watchdog, awaited)
                if messages is grpc.aio.EOF:
                    self.pool.mark_failed(worker, "ended a stream unfinished")
                    raise WorkerFailure(worker, "stream_ended",
                                        f"{worker.role} worker {worker.address} ended the "
                                        "stream without finishing the request")
                if watchdog.is_first:
                    if is_prompt_worker:
                        self.num_cached_tokens = messages[0].num_cached_tokens
                    watchdog.is_first = False
                    watchdog.seconds = self.stall.token_gap_timeout
                    awaited = "the next token"
                last = messages[-1]
                finish = finish_reason_from_proto(last.finish_reason)
                if len(messages) == 1:
                    yield last.token_ids, last.logprobs, finish
                else:
                    yield ([t for m in messages for t in m.token_ids],
                           [p for m in messages for p in m.logprobs], finish)
                if finish is not None:
                    return
        finally:
            watchdog.close()
            worker.num_in_flight -= 1
            receiver.close()

    def _candidates(self, *roles: str, exclude: Collection[tuple[str, str]] = ()
                    ) -> list[WorkerEndpoint]:
        """Healthy workers of these roles that have not failed this request (nor are in
        `exclude`, process keys)."""
        failed = self.migrations.failed_workers
        return [w for role in roles for w in self.pool.healthy(role)
                if w.process_key not in failed and w.process_key not in exclude]

    def _pick(self, attempt: Attempt, *roles: str,
              exclude: Collection[tuple[str, str]] = ()) -> WorkerEndpoint:
        worker = self.pool.pick(*roles, exclude=self.migrations.failed_workers | set(exclude),
                                prompt_token_ids=self.request.prompt_token_ids,
                                note=self.routing_note)
        if worker is None:
            raise self._no_worker(f"no healthy {' or '.join(roles)} worker")
        return self._routed(attempt, worker)

    def _pick_local_prefill(self) -> WorkerEndpoint | None:
        """The decode worker that prefills the request itself, if the policy has one."""
        policy = self.pool.policy
        if policy is None:
            return None
        worker = policy.pick_local_prefill(self._candidates("decode"),
                                           self.request.prompt_token_ids, self.routing_note)
        return None if worker is None else self._routed(self.migrations.current, worker)

    def _routed(self, attempt: Attempt, worker: WorkerEndpoint) -> WorkerEndpoint:
        attempt.workers.append(worker)
        self.metrics.routing_decisions.labels(worker=worker.address, role=worker.role).inc()
        return worker

    def _no_worker(self, need: str) -> RequestError:
        message = f"no healthy workers: {need}"
        if self.migrations.failures:
            message = self.migrations.describe(f"{message} to move the request to after "
                                               f"{len(self.migrations.failures)} failure(s)")
        return RequestError(grpc.StatusCode.UNAVAILABLE, message)

    def _first_token_timeout(self) -> float | None:
        return self.stall.first_token_timeout(len(self.request.prompt_token_ids))

    async def _call(self, worker: WorkerEndpoint, awaitable, stall: float | None | StallWatchdog,
                    awaited: str):
        """`awaitable`'s result; a stall (no result within `stall` seconds, or as the watchdog
        that guards the awaitable says) or a worker-side failure ejects the worker and raises
        WorkerFailure. The worker's own verdicts on the request (INVALID_ARGUMENT,
        OUT_OF_RANGE, ...) pass through as they are."""
        try:
            if isinstance(stall, StallWatchdog):
                return await awaitable
            return await _within(stall, awaitable)
        except asyncio.TimeoutError:
            seconds = stall.seconds if isinstance(stall, StallWatchdog) else stall
            reason = f"did not send {awaited} within {seconds:.1f} s (stall timeout)"
            self.pool.mark_failed(worker, reason, cause="stall")
            raise WorkerFailure(worker, "stall",
                                f"{worker.role} worker {worker.address} {reason}") from None
        except (grpc.aio.AioRpcError, WorkerStatusError) as exc:
            code = exc.code()
            if code in _PASSED_THROUGH:
                raise RequestError(code, exc.details() or code.name) from exc
            cause = "error"
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                        grpc.StatusCode.UNKNOWN):
                self.pool.mark_failed(worker, f"{code.name}: {exc.details()}")
                cause = "unavailable"
            raise WorkerFailure(worker, cause,
                                f"{worker.role} worker {worker.address} failed: {code.name}: "
                                f"{exc.details()}") from exc

    def _abort(self, attempt: Attempt) -> None:
        """Fire-and-forget Abort of `attempt` on every worker it reached (once per attempt)."""
        for worker in attempt.workers:
            task = asyncio.ensure_future(worker.stub.Abort(
                worker_pb2.AbortRequest(request_id=attempt.request_id),
                timeout=ABORT_TIMEOUT_SECONDS))
            _background.add(task)
            task.add_done_callback(_finish_abort)
        attempt.workers = []

    def _complete(self, finish_reason: str | None) -> generate_pb2.Complete:
        now = time.monotonic()
        arrival = self.request.arrival
        num_tokens = len(self.output.token_ids)
        first = self.first_token_time or now
        tpot = (self.last_token_time - first) / (num_tokens - 1) if num_tokens > 1 else 0.0
        if num_tokens > 1:
            self.metrics.time_per_output_token.observe(tpot)
        self.metrics.e2e_latency.observe(now - arrival)
        self.metrics.requests_finished.labels(status=finish_reason or "unknown").inc()
        if self.pool.policy is not None:
            self.pool.policy.record_outcome(self.routing_note, self.num_cached_tokens)
        return generate_pb2.Complete(
            request_id=self.request.request_id,
            finish_reason=finish_reason_to_proto(finish_reason),
            matched_stop=self.output.matched_stop or "",
            usage=generate_pb2.Usage(prompt_tokens=len(self.request.prompt_token_ids),
                                     completion_tokens=num_tokens,
                                     cached_prompt_tokens=self.num_cached_tokens,
                                     num_migrations=self.migrations.num_migrations),
            timings=generate_pb2.Timings(
                queue_seconds=self.request.queue_seconds,
                time_to_first_token_seconds=first - arrival,
                time_per_output_token_seconds=tpot, e2e_seconds=now - arrival,
                prefill_queue_seconds=self.prefill_queue_seconds,
                prefill_compute_seconds=self.prefill_compute_seconds))


class StallWatchdog:
    """The stall timeout of one stream's reads, at the cost of a float per message.

    A timeout per read (asyncio.timeout) schedules and cancels a timer for every token. This
    keeps one timer per stream that re-arms itself when it fires early: a read only moves the
    deadline. When the deadline passes during a read, the reading task is cancelled and that
    read raises asyncio.TimeoutError; time spent outside read() (the client accepting a chunk)
    never counts.
    """

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds  # for the next read; None: no limit
        self.is_first = True  # no message read yet
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._deadline = 0.0
        self._is_reading = False
        self._has_expired = False
        self._timer: asyncio.TimerHandle | None = None

    async def read(self, call):
        """call.read(), raising asyncio.TimeoutError after `seconds` without a message."""
        if self.seconds is None:
            self.close()
            return await call.read()
        self._deadline = self._loop.time() + self.seconds
        if self._timer is None or self._timer.when() > self._deadline:  # a shorter limit
            self.close()
            self._timer = self._loop.call_at(self._deadline, self._fire)
        self._is_reading = True
        try:
            return await call.read()
        except asyncio.CancelledError:
            if not self._has_expired:
                raise
            uncancel = getattr(self._task, "uncancel", None)  # Python 3.11+
            if uncancel is not None:
                uncancel()
            raise asyncio.TimeoutError from None
        finally:
            self._is_reading = False

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        if self.seconds is None:
            self._timer = None
            return
        if not self._is_reading or self._loop.time() < self._deadline:
            # Re-armed at the current deadline: a read that starts later moves it further.
            self._timer = self._loop.call_at(
                max(self._deadline, self._loop.time() + self.seconds), self._fire)
            return
        self._timer = None
        self._has_expired = True
        self._task.cancel()


async def _within(seconds: float | None, awaitable):
    """`await awaitable`, raising asyncio.TimeoutError after `seconds` (None: no limit)."""
    if seconds is None:
        return await awaitable
    if hasattr(asyncio, "timeout"):  # Python 3.11+: re-arms one timer, no task per token
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)


def _finish_abort(task: asyncio.Task) -> None:
    _background.discard(task)
    if not task.cancelled() and task.exception() is not None:
        logger.debug("abort failed: %s", task.exception())

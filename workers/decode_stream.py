"""The worker side of Worker/DecodeStream: many requests' decode streams on one gRPC stream.

Each request the caller sends runs as its own task through the same handler a Decode call
runs (`decode(request, scope)`, an async iterator of DecodeResponse), with a `RequestScope`
in place of the call's context: its deadline comes from the request's timeout_seconds, and
its abort(code, message) ends that request alone with that status. Whatever the requests
yield while the stream is writing its previous message waits in one list and leaves as the
next message, so an engine step's tokens for every request leave together.

The stream's end (the caller went away, the server stopping) cancels every request still on
it; each request's handler then aborts it on the engine, as a cancelled Decode call does.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import grpc

from tandem.common.logging import get_logger
from tandem.v1 import worker_pb2

logger = get_logger(__name__)


class RequestAborted(Exception):
    """Raised by RequestScope.abort: the request ends with this status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class RequestScope:
    """What a request's handler needs of its call, for one request of a DecodeStream."""

    def __init__(self, timeout_seconds: float) -> None:
        self.deadline = time.monotonic() + timeout_seconds if timeout_seconds > 0 else None

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def has_expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    async def abort(self, code: grpc.StatusCode, message: str = "") -> None:
        raise RequestAborted(code, message)


Decode = Callable[[worker_pb2.DecodeRequest, RequestScope],
                  AsyncIterator[worker_pb2.DecodeResponse]]


class DecodeStreamSession:
    """One DecodeStream call: its requests' tasks and the updates waiting to be sent."""

    def __init__(self, decode: Decode, is_closing: Callable[[], bool]) -> None:
        self._decode = decode
        self._is_closing = is_closing
        self._tasks: dict[str, asyncio.Task] = {}
        self._pending: list[worker_pb2.DecodeUpdate] = []
        self._has_pending = asyncio.Event()
        self._has_ended_requests = False  # the caller closed its side

    async def responses(self, requests) -> AsyncIterator[worker_pb2.DecodeStreamResponse]:
        """The stream's messages until the caller closes its side (or the server closes the
        stream) and every request has finished."""
        reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                await self._has_pending.wait()
                self._has_pending.clear()
                if self._pending:
                    updates, self._pending = self._pending, []
                    yield worker_pb2.DecodeStreamResponse(updates=updates)
                if not self._tasks and not self._pending and (
                        self._has_ended_requests or self._is_closing()):
                    return
        finally:
            reader.cancel()
            for task in list(self._tasks.values()):
                task.cancel()

    def wake(self) -> None:
        """Re-check whether the stream may end (the server began closing)."""
        self._has_pending.set()

    async def _read(self, requests) -> None:
        try:
            async for message in requests:
                request = message.start
                if self._is_closing():
                    self._send(request.request_id, status=(
                        grpc.StatusCode.UNAVAILABLE, "the worker is shutting down"))
                    continue
                task = asyncio.create_task(self._run(request, RequestScope(
                    message.timeout_seconds)))
                self._tasks[request.request_id] = task
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            logger.debug("decode stream: reading requests ended: %r", exc)
        finally:
            self._has_ended_requests = True
            self.wake()

    async def _run(self, request: worker_pb2.DecodeRequest, scope: RequestScope) -> None:
        request_id = request.request_id
        task = asyncio.current_task()
        expiry = None
        if scope.deadline is not None:
            expiry = asyncio.get_running_loop().call_later(scope.time_remaining(), task.cancel)
        try:
            async with aclosing(self._decode(request, scope)) as responses:
                async for response in responses:
                    if scope.has_expired():  # what a Decode call past its deadline ends with
                        raise RequestAborted(grpc.StatusCode.DEADLINE_EXCEEDED,
                                             "Deadline Exceeded")
                    self._send(request_id, response)
        except RequestAborted as exc:
            self._send(request_id, status=(exc.code, exc.message))
        except asyncio.CancelledError:
            if scope.has_expired():
                self._send(request_id, status=(grpc.StatusCode.DEADLINE_EXCEEDED,
                                               "Deadline Exceeded"))
            else:
                self._send(request_id, status=(grpc.StatusCode.CANCELLED, "Cancelled"))
        except Exception as exc:  # the status a Decode call's crashed handler ends with
            logger.exception("decode of %s failed", request_id)
            self._send(request_id, status=(grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: "
                                                                    f"{exc}"))
        finally:
            if expiry is not None:
                expiry.cancel()
            if self._tasks.get(request_id) is task:
                del self._tasks[request_id]
            self.wake()

    def _send(self, request_id: str, response: worker_pb2.DecodeResponse | None = None,
              status: tuple[grpc.StatusCode, str] | None = None) -> None:
        update = worker_pb2.DecodeUpdate(request_id=request_id, response=response)
        if status is not None:
            update.status_code = status[0].value[0]
            update.status_message = status[1]
        self._pending.append(update)
        self._has_pending.set()

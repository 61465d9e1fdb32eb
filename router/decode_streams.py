"""The router side of Worker/DecodeStream: one gRPC stream per worker carries the decoding of
every request this router has on it.

`worker.decode_stream.start(worker.stub, request, timeout)` sends a request and returns its
`DecodeReceiver`; the stream's reader hands each update to its request's receiver. A
receiver reads like a Decode call: `read()` returns every update that arrived since the
previous read (several when the reader was behind: they become one client chunk), then
raises the request's error status as a `WorkerStatusError`, or returns grpc.aio.EOF when the
stream ended without finishing the request. When the stream fails (the worker died, the
connection broke), every request on it gets that error: each is failed on that worker, as a
broken Decode call was. The next request opens a new stream.
"""
from __future__ import annotations

import asyncio

import grpc

from tandem.common.logging import get_logger
from tandem.v1 import worker_pb2

logger = get_logger(__name__)


class WorkerStatusError(Exception):
    """A request's error status sent by the worker; code() and details() as AioRpcError's."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class DecodeReceiver:
    """One request's updates from its worker's DecodeStream."""

    __slots__ = ("request_id", "_session", "_updates", "_failure", "_waiter")

    def __init__(self, request_id: str, session: _Session) -> None:
        self.request_id = request_id
        self._session = session
        self._updates: list[worker_pb2.DecodeResponse] = []
        self._failure: BaseException | object | None = None  # an exception, or grpc.aio.EOF
        self._waiter: asyncio.Future | None = None

    async def read(self) -> list[worker_pb2.DecodeResponse] | object:
        """The responses that arrived since the previous read (waits for one), oldest first;
        grpc.aio.EOF when the stream ended without finishing the request; raises the
        request's error (WorkerStatusError, or the stream's AioRpcError)."""
        if not self._updates and self._failure is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._updates:
            updates, self._updates = self._updates, []
            return updates
        if isinstance(self._failure, BaseException):
            raise self._failure
        return self._failure

    def close(self) -> None:
        """The request is done with this worker: later updates for it are dropped."""
        self._session.receivers.pop(self.request_id, None)

    def _deliver(self, update: worker_pb2.DecodeUpdate) -> None:
        if update.HasField("response"):
            self._updates.append(update.response)
        if update.status_code:
            code = _STATUS_CODES.get(update.status_code, grpc.StatusCode.UNKNOWN)
            self._end(WorkerStatusError(code, update.status_message))
        else:
            self._wake()

    def _end(self, failure: BaseException | object) -> None:
        if self._failure is None:
            self._failure = failure
        self._session.receivers.pop(self.request_id, None)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Session:
    """One DecodeStream call and the requests sent on it."""

    def __init__(self, stub) -> None:
        self.stub = stub
        self.receivers: dict[str, DecodeReceiver] = {}
        self.is_open = True
        self._outbox: asyncio.Queue[worker_pb2.DecodeStreamRequest] = asyncio.Queue()
        self.call = stub.DecodeStream(self._requests())
        self._reader = asyncio.create_task(self._read())

    def send(self, message: worker_pb2.DecodeStreamRequest) -> None:
        self._outbox.put_nowait(message)

    def cancel(self) -> None:
        self.call.cancel()

    async def _requests(self):
        while True:
            yield await self._outbox.get()

    async def _read(self) -> None:
        failure: BaseException | object = grpc.aio.EOF
        try:
            while True:
                message = await self.call.read()
                if message is grpc.aio.EOF:
                    break
                receivers = self.receivers
                for update in message.updates:
                    receiver = receivers.get(update.request_id)
                    if receiver is not None:
                        receiver._deliver(update)
        except grpc.aio.AioRpcError as exc:
            failure = exc
        except asyncio.CancelledError:
            failure = grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), "the router closed the stream")
            raise
        finally:
            self.is_open = False
            for receiver in list(self.receivers.values()):
                receiver._end(failure)


class DecodeStream:
    """A worker's shared DecodeStream for this router (opened on first use, and again after
    it ended or the worker's channel was replaced)."""

    def __init__(self) -> None:
        self._session: _Session | None = None

    def start(self, stub, request: worker_pb2.DecodeRequest,
              timeout_seconds: float | None) -> DecodeReceiver:
        """Sends `request` on the stream of `stub`'s channel; its receiver."""
        session = self._session
        if session is None or not session.is_open or session.stub is not stub:
            if session is not None and session.is_open and not session.receivers:
                session.cancel()  # the channel was replaced; nothing waits on the old one
            session = self._session = _Session(stub)
        receiver = DecodeReceiver(request.request_id, session)
        session.receivers[request.request_id] = receiver
        session.send(worker_pb2.DecodeStreamRequest(start=request,
                                                    timeout_seconds=timeout_seconds or 0.0))
        return receiver

    def close(self) -> None:
        if self._session is not None:
            self._session.cancel()
            self._session = None

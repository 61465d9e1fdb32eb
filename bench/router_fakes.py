"""The router microbenchmark's fake worker: a real gRPC server of the worker protocol with no
engine behind it.

It answers what the router calls (grpc.health.v1 Check, Worker/GetLoad, DecodeStream,
Decode, Prefill, Abort) as an aggregated ("both") worker would, so it also serves a router
that makes one Decode call per request (bench/router.py --router-python). A step loop stands
in for the engine: every `step_seconds` (0: as fast as the event loop turns) it appends the
next token to every open request, up to the request's max_tokens. Each DecodeStream sends, as
the real servicer does, every request's tokens made since its previous message in one message,
so one step's tokens leave together and a stream that falls behind the steps coalesces; a
Decode call sends its request's tokens made since its previous message. Token ids walk a
text encoded with the served model's tokenizer (a different starting point per request), so
the router's detokenizer and stop-string scan do the work they do on real output.

For the latency figures every message's send time and every token's step time
(time.monotonic(), the clock every process on the host shares) are recorded per request,
under the id the client chose: the router names a worker-side request `<client id>.<uuid>`.
"""
from __future__ import annotations

import asyncio
import time
import zlib
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.v1 import generate_pb2, worker_pb2, worker_pb2_grpc

# Prose with punctuation, digits, code and a few multi-byte characters: what a chat model
# streams. Repeated with variations by corpus_text() to a few thousand tokens.
_PASSAGE = (
    "The router tokenizes each prompt, admits it, and relays the tokens that the decode "
    "worker streams back. In 2024, a single H100 served about 3,500 tokens per second for an "
    "8B model; with batching, throughput grows roughly linearly until memory bandwidth is "
    "saturated. Consider the function below:\n\n```python\ndef mean(values: list[float]) -> "
    "float:\n    return sum(values) / len(values) if values else 0.0\n```\n\nIt returns 0.0 "
    "for an empty list. Café, naïve, Zürich and 東京 need multi-byte characters; emoji such as "
    "🚀 or ✅ need four bytes each. Finally, note that \"quotes\", (parentheses) and "
    "[brackets] tokenize differently at the start of a word than in its middle.\n\n"
)


def corpus_text(num_passages: int = 24) -> str:
    """A few thousand tokens of varied text (numbered passages, so no two are equal)."""
    return "".join(f"{index + 1}. {_PASSAGE}" for index in range(num_passages))


class FakeWorker(health_pb2_grpc.HealthServicer, worker_pb2_grpc.WorkerServicer):
    def __init__(self, token_ids: list[int], step_seconds: float, model: str) -> None:
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        self.token_ids = token_ids
        self.step_seconds = step_seconds
        self.model = model
        self._streams: dict[str, _Stream] = {}
        # client request id -> [(send time, tokens in the message)], filled by DecodeStream.
        self.sends: dict[str, list[tuple[float, int]]] = {}
        # client request id -> [(time of the step that made it, 1)] per token.
        self.steps: dict[str, list[tuple[float, int]]] = {}

    def take_sends(self) -> dict[str, list[tuple[float, int]]]:
        """Every send recorded so far; starts a new record."""
        sends, self.sends = self.sends, {}
        return sends

    def take_steps(self) -> dict[str, list[tuple[float, int]]]:
        """Every token's step time recorded so far; starts a new record."""
        steps, self.steps = self.steps, {}
        return steps

    async def run_steps(self) -> None:
        """The stand-in engine: one token for every open stream per step."""
        while True:
            await asyncio.sleep(self.step_seconds)
            step_time = time.monotonic()
            for stream in self._streams.values():
                stream.step(self.token_ids, step_time)

    async def Check(self, request, context):  # noqa: N802 (gRPC's naming)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def GetLoad(self, request, context):  # noqa: N802
        return worker_pb2.GetLoadResponse(role="both", num_running=len(self._streams),
                                          model=self.model)

    async def Abort(self, request, context):  # noqa: N802
        stream = self._streams.pop(request.request_id, None)
        if stream is not None:
            stream.session.streams.pop(request.request_id, None)
        return worker_pb2.AbortResponse(found=stream is not None)

    async def Prefill(self, request, context):  # noqa: N802
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            "the fake worker serves aggregated (both) requests only")

    async def Decode(self, request, context):  # noqa: N802
        """One request on a call of its own (what a router without DecodeStream calls): each
        message carries the request's tokens made since its previous one."""
        session = _Session()
        stream = self._open(request, session)
        try:
            while stream.request_id in session.streams:
                await session.ready.wait()
                session.ready.clear()
                update = self._take_update(stream)
                if update is not None:
                    yield update.response
        finally:
            self._streams.pop(stream.request_id, None)

    async def DecodeStream(self, request_iterator, context):  # noqa: N802
        session = _Session()
        reader = asyncio.create_task(self._read_requests(request_iterator, session))
        try:
            while True:
                await session.ready.wait()
                session.ready.clear()
                updates = [update for stream in list(session.streams.values())
                           if (update := self._take_update(stream)) is not None]
                if updates:
                    yield worker_pb2.DecodeStreamResponse(updates=updates)
        finally:
            reader.cancel()
            for request_id in session.streams:
                self._streams.pop(request_id, None)

    async def _read_requests(self, request_iterator, session: _Session) -> None:
        async for message in request_iterator:
            self._open(message.start, session)

    def _open(self, request: worker_pb2.DecodeRequest, session: _Session) -> _Stream:
        request_id = request.request_id
        start = zlib.crc32(request_id.encode()) % len(self.token_ids)
        stream = _Stream(request_id, request.params.max_tokens, start,
                         request.params.HasField("logprobs"), session)
        self._streams[request_id] = session.streams[request_id] = stream
        self.sends[request_id.rsplit(".", 1)[0]] = stream.sends
        self.steps[request_id.rsplit(".", 1)[0]] = stream.steps
        return stream

    def _take_update(self, stream: _Stream) -> worker_pb2.DecodeUpdate | None:
        """The stream's tokens made since its previous update (None: none)."""
        token_ids = stream.pending
        if not token_ids:
            return None
        stream.pending = []
        stream.num_sent += len(token_ids)
        finished = stream.num_sent >= stream.max_tokens
        response = worker_pb2.DecodeResponse(
            token_ids=token_ids,
            finish_reason=generate_pb2.FINISH_REASON_LENGTH if finished else 0)
        if stream.wants_logprobs:
            response.logprobs.extend(generate_pb2.TokenLogprob(
                token_id=t, logprob=-0.5, rank=1, top=[generate_pb2.TopLogprob(
                    token_id=t, logprob=-0.5)]) for t in token_ids)
        if finished:
            del self._streams[stream.request_id]
            del stream.session.streams[stream.request_id]
        stream.sends.append((time.monotonic(), len(token_ids)))
        return worker_pb2.DecodeUpdate(request_id=stream.request_id, response=response)

    def register(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self, server)
        worker_pb2_grpc.add_WorkerServicer_to_server(self, server)


class _Session:
    """One DecodeStream call: its open streams, and whether a step gave any a token."""

    def __init__(self) -> None:
        self.streams: dict[str, _Stream] = {}
        self.ready = asyncio.Event()


class _Stream:
    """One request of a DecodeStream, between the step loop and the stream's writer."""

    def __init__(self, request_id: str, max_tokens: int, position: int, wants_logprobs: bool,
                 session: _Session) -> None:
        self.request_id = request_id
        self.max_tokens = max_tokens
        self.position = position
        self.wants_logprobs = wants_logprobs
        self.session = session
        self.pending: list[int] = []
        self.num_made = 0
        self.num_sent = 0
        self.sends: list[tuple[float, int]] = []  # (send time, tokens in the message)
        self.steps: list[tuple[float, int]] = []  # (step time, 1) per token made

    def step(self, token_ids: list[int], step_time: float) -> None:
        if self.num_made >= self.max_tokens:
            return
        self.steps.append((step_time, 1))
        self.pending.append(token_ids[self.position % len(token_ids)])
        self.position += 1
        self.num_made += 1
        self.session.ready.set()


def serve_fake_worker(port: int, token_ids: list[int], step_seconds: float, model: str,
                      commands) -> None:
    """Process entry point: serve on 127.0.0.1:`port` until told to stop. `commands` is a
    multiprocessing connection: "sends" answers take_sends(), "steps" take_steps(), a float
    sets step_seconds, "stop" ends the process."""
    worker = FakeWorker(token_ids, step_seconds, model)

    async def main() -> None:
        server = grpc.aio.server()
        worker.register(server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        steps = asyncio.create_task(worker.run_steps())
        loop = asyncio.get_running_loop()
        commands.send("started")
        while True:
            command = await loop.run_in_executor(None, commands.recv)
            if command == "stop":
                break
            if isinstance(command, float):
                worker.step_seconds = command
                commands.send("ok")
            elif command == "steps":
                commands.send(worker.take_steps())
            else:
                commands.send(worker.take_sends())
        steps.cancel()
        await server.stop(0)

    asyncio.run(main())


def start_fake_worker(model: str, port: int, step_seconds: float):
    """A fake worker streaming `model`'s tokenization of the corpus, in a spawned process on
    127.0.0.1:`port`; returns (process, its command connection) once it serves."""
    import multiprocessing

    from transformers import AutoTokenizer

    token_ids = AutoTokenizer.from_pretrained(model).encode(corpus_text(),
                                                            add_special_tokens=False)
    context = multiprocessing.get_context("spawn")
    commands, worker_end = context.Pipe()
    process = context.Process(target=serve_fake_worker, daemon=True, args=(
        port, token_ids, step_seconds, Path(model).name, worker_end))
    process.start()
    if commands.recv() != "started":
        raise RuntimeError("the fake worker did not start")
    return process, commands


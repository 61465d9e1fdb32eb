"""Python client for a Tandem router (the `tandem.v1.Generate` service).

    from tandem.client import TandemClient

    with TandemClient("127.0.0.1:50051", timeout=60) as client:
        result = client.generate("The capital of France is", max_tokens=16, temperature=0)
        print(result.text, result.finish_reason, result.usage, result.client_ttft_seconds)

        stream = client.stream(messages=[{"role": "user", "content": "Hi!"}], max_tokens=64)
        for delta in stream:                  # StreamDelta(text, token_ids, logprobs)
            print(delta.text, end="", flush=True)
        print(stream.result.timings)          # GenerationResult, set once the stream has ended

A secured router: `TandemClient(address, token="...", tls_ca="ca.pem", tls_cert="me.pem",
tls_key="me.key")` sends `authorization: Bearer <token>` on every call and speaks TLS (a client
certificate with cert and key, as Tandem's mutual TLS requires; `tls_server_name` when the
router's certificate names another host than the one dialled).

`AsyncTandemClient` has the same methods as coroutines; its `stream()` returns an async iterator
with the same `.result`. Failures raise `grpc.RpcError` (`.code()`, `.details()`) as the router
sent them. Leaving a stream early: call its `cancel()` (or use it as a context manager), which
cancels the call and so aborts the request on every worker.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from tandem.v1 import generate_pb2 as pb
from tandem.v1 import generate_pb2_grpc

__all__ = ["AsyncGenerationStream", "AsyncTandemClient", "GenerationResult", "GenerationStream",
           "StreamDelta", "TandemClient", "TokenLogprob", "build_request"]
DEFAULT_ADDRESS = "127.0.0.1:50051"


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability of one generated token, and the most likely alternatives (id, logprob)."""
    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """Output since the previous delta: new text, new token ids, their logprobs if asked for."""
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """A finished generation. `finish_reason` is "stop", "length" or "abort"; `usage` and
    `timings` hold the router's Usage and Timings fields by name (timings in seconds, measured
    at the router); the `client_*` times are measured here (None when too few tokens came)."""
    text: str
    token_ids: list[int]
    finish_reason: str
    matched_stop: str
    request_id: str
    usage: dict[str, int]
    timings: dict[str, float]
    client_ttft_seconds: float | None
    client_tpot_seconds: float | None
    client_e2e_seconds: float
    logprobs: list[TokenLogprob] | None = None


def build_request(prompt: str | Sequence[int] | None = None, *,
                  messages: Sequence[dict] | None = None, request_id: str | None = None,
                  model: str | None = None, max_tokens: int | None = None,
                  min_tokens: int | None = None, temperature: float | None = None,
                  top_p: float | None = None, top_k: int | None = None,
                  min_p: float | None = None, repetition_penalty: float | None = None,
                  presence_penalty: float | None = None, frequency_penalty: float | None = None,
                  seed: int | None = None, stop: str | Sequence[str] | None = None,
                  stop_token_ids: Sequence[int] | None = None, ignore_eos: bool | None = None,
                  logprobs: int | None = None) -> pb.GenerateRequest:
    """A GenerateRequest with exactly the fields given; None leaves a field unset, so the
    router's documented default applies. The prompt is text (str), token ids (a sequence of
    ints) or chat `messages` ([{"role": ..., "content": ...}, ...]): exactly one of them."""
    if (prompt is None) == (messages is None):
        raise ValueError("prompt/messages: give exactly one of them")
    request = pb.GenerateRequest(request_id=request_id or "", model=model or "")
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.SetInParent()
        request.token_ids.ids.extend(int(token_id) for token_id in prompt)
    else:
        request.chat.SetInParent()
        request.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"])
                                     for m in messages)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                    repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                    frequency_penalty=frequency_penalty, seed=seed)
    for name, value in sampling.items():
        if value is not None:
            setattr(request.sampling, name, value)
    for name, value in dict(max_tokens=max_tokens, min_tokens=min_tokens,
                            ignore_eos=ignore_eos).items():
        if value is not None:
            setattr(request.stop, name, value)
    if stop is not None:
        request.stop.stop.extend([stop] if isinstance(stop, str) else stop)
    if stop_token_ids is not None:
        request.stop.stop_token_ids.extend(int(token_id) for token_id in stop_token_ids)
    if logprobs is not None:
        request.logprobs = logprobs
    return request


def _fields(message) -> dict:
    return {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields}


def _model_info(reply: pb.GetModelInfoResponse) -> dict:
    info = _fields(reply)
    info["architectures"] = list(reply.architectures)
    info["eos_token_ids"] = list(reply.eos_token_ids)
    return info


class _Collector:
    """Folds a response stream into deltas and a result, timing token arrivals on the client."""

    def __init__(self, want_logprobs: bool) -> None:
        self.started_at = time.perf_counter()
        self.want_logprobs = want_logprobs
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.first_output_at: float | None = None
        self.last_token_at: float | None = None
        self.complete: pb.Complete | None = None

    def add(self, response: pb.GenerateResponse) -> StreamDelta | None:
        if response.WhichOneof("response") == "complete":
            self.complete = response.complete
            return None
        now, chunk = time.perf_counter(), response.chunk
        if self.first_output_at is None and (chunk.token_ids or chunk.text):
            self.first_output_at = now
        if chunk.token_ids:
            self.last_token_at = now
        token_ids = list(chunk.token_ids)
        self.texts.append(chunk.text)
        self.token_ids.extend(token_ids)
        logprobs = None
        if self.want_logprobs:
            logprobs = [TokenLogprob(lp.token_id, lp.logprob, lp.rank,
                                     tuple((t.token_id, t.logprob) for t in lp.top))
                        for lp in chunk.logprobs]
            self.logprobs.extend(logprobs)
        return StreamDelta(chunk.text, token_ids, logprobs)

    def result(self) -> GenerationResult:
        if self.complete is None:
            raise RuntimeError("the Generate stream ended without its Complete message")
        c, num_tokens = self.complete, len(self.token_ids)
        ttft = None if self.first_output_at is None else self.first_output_at - self.started_at
        tpot = None
        if num_tokens >= 2 and self.first_output_at is not None:
            tpot = (self.last_token_at - self.first_output_at) / (num_tokens - 1)
        reason = pb.FinishReason.Name(c.finish_reason).removeprefix("FINISH_REASON_").lower()
        return GenerationResult(
            text="".join(self.texts), token_ids=self.token_ids, finish_reason=reason,
            matched_stop=c.matched_stop, request_id=c.request_id, usage=_fields(c.usage),
            timings=_fields(c.timings), client_ttft_seconds=ttft, client_tpot_seconds=tpot,
            client_e2e_seconds=time.perf_counter() - self.started_at,
            logprobs=self.logprobs if self.want_logprobs else None)


class GenerationStream:
    """Iterates StreamDelta; once exhausted, `.result` holds the GenerationResult."""

    def __init__(self, call, collector: _Collector) -> None:
        self._call, self._collector = call, collector
        self.result: GenerationResult | None = None

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> StreamDelta:
        while True:
            try:
                response = next(self._call)
            except StopIteration:
                self.result = self._collector.result()
                raise
            delta = self._collector.add(response)
            if delta is not None:
                return delta

    def cancel(self) -> None:
        """Cancel the call (the router aborts the request); a no-op once it has ended."""
        self._call.cancel()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.cancel()


@dataclass(frozen=True, slots=True)
class _Connection:
    """How to reach a router: channel credentials and options, and per-call metadata."""
    credentials: grpc.ChannelCredentials | None
    options: list[tuple[str, str]]
    metadata: tuple[tuple[str, str], ...] | None

    @classmethod
    def of(cls, token: str | None, tls_ca: str | None, tls_cert: str | None,
           tls_key: str | None, tls_server_name: str | None) -> _Connection:
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together (a client certificate)")
        if tls_cert is not None and tls_ca is None:
            raise ValueError("tls_cert needs tls_ca (the CA that signs the router)")
        credentials = None
        if tls_ca is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(tls_ca), private_key=_read(tls_key),
                certificate_chain=_read(tls_cert))
        options = ([("grpc.ssl_target_name_override", tls_server_name)]
                   if tls_server_name else [])
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        return cls(credentials, options, metadata)

    def channel(self, address: str) -> grpc.Channel:
        if self.credentials is None:
            return grpc.insecure_channel(address, options=self.options)
        return grpc.secure_channel(address, self.credentials, options=self.options)

    def aio_channel(self, address: str) -> grpc.aio.Channel:
        if self.credentials is None:
            return grpc.aio.insecure_channel(address, options=self.options)
        return grpc.aio.secure_channel(address, self.credentials, options=self.options)


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).expanduser().read_bytes()


class TandemClient:
    """Blocking client over one gRPC channel. `timeout` is the default deadline per call;
    `token` and the `tls_*` files reach a secured router (module docstring)."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, timeout: float | None = None,
                 token: str | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None,
                 tls_server_name: str | None = None) -> None:
        self.address, self.timeout = address, timeout
        self._connection = _Connection.of(token, tls_ca, tls_cert, tls_key, tls_server_name)
        self._channel = self._connection.channel(address)
        self._stub = generate_pb2_grpc.GenerateStub(self._channel)

    def stream(self, prompt: str | Sequence[int] | None = None, *,
               messages: Sequence[dict] | None = None, timeout: float | None = None,
               **params) -> GenerationStream:
        """Start a generation; `params` are build_request's keyword arguments."""
        request = build_request(prompt, messages=messages, **params)
        collector = _Collector(request.HasField("logprobs"))
        call = self._stub.Generate(request, timeout=self._deadline(timeout),
                                   metadata=self._connection.metadata)
        return GenerationStream(call, collector)

    def generate(self, prompt: str | Sequence[int] | None = None, *,
                 messages: Sequence[dict] | None = None, timeout: float | None = None,
                 **params) -> GenerationResult:
        """Run a generation to the end; `params` are build_request's keyword arguments."""
        with self.stream(prompt, messages=messages, timeout=timeout, **params) as stream:
            for _ in stream:
                pass
        return stream.result

    def model_info(self, *, timeout: float | None = None) -> dict:
        """The served model: model, architectures, max_model_len, vocab_size, eos_token_ids,
        has_chat_template."""
        reply = self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._deadline(timeout),
                                        metadata=self._connection.metadata)
        return _model_info(reply)

    def _deadline(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class AsyncGenerationStream:
    """Async-iterates StreamDelta; once exhausted, `.result` holds the GenerationResult."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, collector: _Collector) -> None:
        self._call, self._collector = call, collector
        self.result: GenerationResult | None = None

    def __aiter__(self) -> AsyncGenerationStream:
        return self

    async def __anext__(self) -> StreamDelta:
        while True:
            response = await self._call.read()
            if response is grpc.aio.EOF:
                self.result = self._collector.result()
                raise StopAsyncIteration
            delta = self._collector.add(response)
            if delta is not None:
                return delta

    def cancel(self) -> None:
        """Cancel the call (the router aborts the request); a no-op once it has ended."""
        self._call.cancel()

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.cancel()


class AsyncTandemClient:
    """TandemClient over grpc.aio; create and use it inside one running event loop."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, timeout: float | None = None,
                 token: str | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None,
                 tls_server_name: str | None = None) -> None:
        self.address, self.timeout = address, timeout
        self._connection = _Connection.of(token, tls_ca, tls_cert, tls_key, tls_server_name)
        self._channel = self._connection.aio_channel(address)
        self._stub = generate_pb2_grpc.GenerateStub(self._channel)

    def stream(self, prompt: str | Sequence[int] | None = None, *,
               messages: Sequence[dict] | None = None, timeout: float | None = None,
               **params) -> AsyncGenerationStream:
        """Start a generation (use with `async for`); `params` as in build_request."""
        request = build_request(prompt, messages=messages, **params)
        collector = _Collector(request.HasField("logprobs"))
        return AsyncGenerationStream(
            self._stub.Generate(request, timeout=self._deadline(timeout),
                                metadata=self._connection.metadata), collector)

    async def generate(self, prompt: str | Sequence[int] | None = None, *,
                       messages: Sequence[dict] | None = None, timeout: float | None = None,
                       **params) -> GenerationResult:
        """Run a generation to the end; `params` are build_request's keyword arguments."""
        async with self.stream(prompt, messages=messages, timeout=timeout, **params) as stream:
            async for _ in stream:
                pass
        return stream.result

    async def model_info(self, *, timeout: float | None = None) -> dict:
        """As TandemClient.model_info."""
        reply = await self._stub.GetModelInfo(pb.GetModelInfoRequest(),
                                              timeout=self._deadline(timeout),
                                              metadata=self._connection.metadata)
        return _model_info(reply)

    def _deadline(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncTandemClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

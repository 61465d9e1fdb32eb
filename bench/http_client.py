"""The load generator's client for the router's OpenAI-compatible HTTP API (`tandem bench --http`).

It offers what LoadGenerator and the runner use of AsyncTandemClient -- `model_info()` and
`stream(...)` yielding StreamDelta, then `.result` -- so both transports share one load loop
and one clock: a delta is timed when the loop receives it, as a gRPC message is. Requests go
to /v1/completions (token ids or text; /v1/chat/completions for messages) as server-sent
events with `return_token_ids` (each chunk names its tokens, so tokens are counted exactly, even
while text is held back) and `stream_options.include_usage`.

Failures raise HTTPCallError, a grpc.RpcError whose code() is the gRPC status the router named
(or the HTTP status's equivalent), so the load loop records both transports' errors alike.
"""
from __future__ import annotations

import json
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import httpx2

from tandem.client import StreamDelta

__all__ = ["HTTPBenchClient", "HTTPCallError", "HTTPResult"]
_STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                 404: grpc.StatusCode.NOT_FOUND, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                 503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


class HTTPCallError(grpc.RpcError):
    """A failed HTTP call, told as a gRPC status: code() and details()."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    @classmethod
    def from_body(cls, status: int, body: bytes | dict) -> HTTPCallError:
        """From an OpenAI error body ({"error": {"message", "code"}}); `code` is the gRPC
        status name Tandem sends, else the HTTP status decides."""
        try:
            error = (json.loads(body) if isinstance(body, bytes) else body)["error"]
            message, name = str(error.get("message", "")), error.get("code")
        except (ValueError, KeyError, TypeError, AttributeError):
            message, name = (body[:200].decode(errors="replace") if isinstance(body, bytes)
                             else str(body)), None
        code = getattr(grpc.StatusCode, name, None) if isinstance(name, str) else None
        if not isinstance(code, grpc.StatusCode):
            code = _STATUS_CODES.get(status, grpc.StatusCode.UNKNOWN)
        return cls(code, f"HTTP {status}: {message}")


@dataclass(slots=True)
class HTTPResult:
    """What the stream's last chunks said: finish reason and usage (the router's timings do
    not travel over HTTP)."""
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)


class HTTPStream:
    """One streamed completion; use as `async with stream: async for delta in stream`."""

    def __init__(self, client: httpx2.AsyncClient, path: str, body: dict,
                 headers: dict[str, str], timeout: float | None,
                 extensions: dict | None = None) -> None:
        self._client, self._path, self._body = client, path, body
        self._headers, self._timeout, self._extensions = headers, timeout, extensions
        self._context = None
        self._lines = None
        self.result: HTTPResult | None = None
        self._partial = HTTPResult()

    async def __aenter__(self) -> HTTPStream:
        self._context = self._client.stream("POST", self._path, json=self._body,
                                            headers=self._headers, timeout=self._timeout,
                                            extensions=self._extensions)
        try:
            response = await self._context.__aenter__()
        except httpx2.TimeoutException as exc:
            raise HTTPCallError(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)) from None
        except httpx2.TransportError as exc:
            raise HTTPCallError(grpc.StatusCode.UNAVAILABLE, str(exc) or type(exc).__name__
                                ) from None
        if response.status_code != 200:
            error = HTTPCallError.from_body(response.status_code, await response.aread())
            await self._context.__aexit__(None, None, None)  # no __aexit__ follows a raise here
            self._context = None
            raise error
        self._lines = response.aiter_lines()
        return self

    async def __aexit__(self, *exc_info) -> None:
        """Closes the connection's response; a stream left early aborts the request."""
        if self._context is not None:
            await self._context.__aexit__(*exc_info)

    def __aiter__(self) -> HTTPStream:
        return self

    async def __anext__(self) -> StreamDelta:
        while True:
            try:
                line = await anext(self._lines)
            except StopAsyncIteration:
                raise RuntimeError("the event stream ended without data: [DONE]") from None
            except httpx2.TimeoutException as exc:
                raise HTTPCallError(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)) from None
            except httpx2.TransportError as exc:
                raise HTTPCallError(grpc.StatusCode.UNAVAILABLE,
                                    str(exc) or type(exc).__name__) from None
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                if self._partial.finish_reason is None:
                    raise RuntimeError("the event stream ended without a finish_reason")
                self.result = self._partial
                raise StopAsyncIteration
            delta = self._add(json.loads(data))
            if delta is not None:
                return delta

    def _add(self, event: dict) -> StreamDelta | None:
        if "error" in event:
            raise HTTPCallError.from_body(200, event)
        if event.get("usage"):
            self._partial.usage = event["usage"]
        text, token_ids = "", []
        for choice in event.get("choices", ()):
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            token_ids += choice.get("token_ids") or []
            if choice.get("finish_reason"):
                self._partial.finish_reason = choice["finish_reason"]
        return StreamDelta(text, token_ids) if token_ids or text else None


class HTTPBenchClient:
    """AsyncTandemClient's bench-facing half over HTTP. `base_url`: http(s)://host:port or
    host:port (https when `tls_ca` is given)."""

    def __init__(self, base_url: str, *, token: str | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None,
                 tls_server_name: str | None = None) -> None:
        if "://" not in base_url:
            base_url = f"{'https' if tls_ca else 'http'}://{base_url}"
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        verify: ssl.SSLContext | bool = True
        if tls_ca is not None:
            verify = ssl.create_default_context(cafile=tls_ca)
            if tls_cert is not None:
                verify.load_cert_chain(tls_cert, tls_key)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._extensions = {"sni_hostname": tls_server_name} if tls_server_name else None
        # Every in-flight request holds a connection: no pool limit, or the pool would queue
        # requests the load shape meant to send.
        self._client = httpx2.AsyncClient(
            base_url=self.base_url, verify=verify, timeout=None, trust_env=False,
            limits=httpx2.Limits(max_connections=None, max_keepalive_connections=None))

    async def model_info(self, *, timeout: float | None = None) -> dict:
        """GetModelInfo's fields from /v1/models (Tandem adds vocab_size and eos_token_ids)."""
        try:
            reply = await self._client.get("/v1/models", headers=self._headers,
                                           timeout=timeout, extensions=self._extensions)
        except httpx2.TransportError as exc:
            raise HTTPCallError(grpc.StatusCode.UNAVAILABLE,
                                f"{self.base_url}: {exc or type(exc).__name__}") from None
        if reply.status_code != 200:
            raise HTTPCallError.from_body(reply.status_code, reply.content)
        model = reply.json()["data"][0]
        missing = [k for k in ("vocab_size", "eos_token_ids", "max_model_len") if k not in model]
        if missing:
            raise HTTPCallError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"/v1/models does not give {', '.join(missing)} (not a "
                                "Tandem router?)")
        return {"model": model["id"], "vocab_size": model["vocab_size"],
                "eos_token_ids": list(model["eos_token_ids"]),
                "max_model_len": model["max_model_len"]}

    def stream(self, prompt: str | Sequence[int] | None = None, *,
               messages: Sequence[dict] | None = None, timeout: float | None = None,
               request_id: str = "", max_tokens: int | None = None,
               min_tokens: int | None = None, temperature: float | None = None,
               seed: int | None = None) -> HTTPStream:
        """A streamed completion with the load generator's parameters; `timeout` is both the
        router's deadline (X-Request-Timeout) and this client's."""
        body: dict = {"stream": True, "stream_options": {"include_usage": True},
                      "return_token_ids": True}
        if messages is not None:
            path, body["messages"] = "/v1/chat/completions", list(messages)
        else:
            path, body["prompt"] = "/v1/completions", prompt
        for name, value in (("max_tokens", max_tokens), ("min_tokens", min_tokens),
                            ("temperature", temperature), ("seed", seed)):
            if value is not None:
                body[name] = value
        headers = dict(self._headers)  # request_id: the HTTP API assigns its own ids
        if timeout is not None:
            headers["X-Request-Timeout"] = f"{timeout:g}"
        return HTTPStream(self._client, path, body, headers, timeout, self._extensions)

    async def close(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> HTTPBenchClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

"""The router's OpenAI-compatible HTTP API: an ASGI app served beside gRPC in one event loop.

Every completion goes through `GenerateServicer.stream`, the path gRPC calls take: the same
validation, tokenization, admission, routing, metrics and abort on every worker when the
client goes away: a closed connection cancels the generators, as a cancelled RPC does, whether
the response streams or not.

    POST /v1/chat/completions, POST /v1/completions   bearer token when configured
    GET  /v1/models                                    bearer token when configured
    POST /v1/tokenize, POST /v1/detokenize             bearer token when configured
    GET  /health                                       200 while workers can serve, else 503
    GET  /version

Every completion has a deadline, as a gRPC call has: the `X-Request-Timeout` header's seconds,
else the router's default (--http-request-timeout-seconds). Past it the request is aborted on
every worker and answered 504 (or, once a stream has started, ended with an error event).

Errors are `{"error": {"message", "type", "param", "code"}}`; the HTTP status follows the
gRPC code the servicer gives (HTTP_STATUS), and `code` is that gRPC code's name. Responses are
plain dicts in OpenAI's shapes, serialized once per chunk.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import math
import re
import time
import uuid
from dataclasses import dataclass
from contextlib import aclosing

import grpc
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from tandem import __version__
from tandem.common.convert import finish_reason_from_proto
from tandem.router.admission import RETRY_AFTER_KEY
from tandem.router.openai_schema import (ChatCompletionRequest, CompletionRequest,
                                         DetokenizeRequest, OpenAIError, TokenizeRequest)
from tandem.router.servicer import GenerateServicer
from tandem.router.tool_calls import ParsedCall, ToolCallStream, parse_tool_calls
from tandem.router.validation import RequestError, check_request
from tandem.v1 import generate_pb2

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 429: "rate_limit_error"}
# The request field a servicer message starts with -> the OpenAI field it came from.
_PARAM_NAMES = {"chat.tools": "tools", "chat.tool_choice": "tool_choice", "text": "prompt",
                "token_ids": "prompt", "prompt": "prompt", "chat": "messages", "stop.stop": "stop",
                "model": "model", "logprobs": "logprobs", "structured_output": "response_format"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
TIMEOUT_HEADER = "x-request-timeout"  # seconds; this completion's deadline
DEFAULT_REQUEST_TIMEOUT_SECONDS = 600.0


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @classmethod
    def from_request_error(cls, exc: RequestError) -> HTTPError:
        status = HTTP_STATUS.get(exc.code, 500)
        headers = {}
        retry_after_ms = dict(exc.trailing_metadata).get(RETRY_AFTER_KEY)
        if retry_after_ms is not None:
            headers["Retry-After"] = str(max(1, math.ceil(int(retry_after_ms) / 1000)))
        return cls(status, exc.message, _param_of(exc.message), exc.code.name, headers)

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, self.headers)


def _param_of(message: str) -> str | None:
    """The OpenAI field a servicer message names ("sampling.top_p=1.5 must ..." -> top_p)."""
    match = re.match(r"([a-z_]+(?:\.[a-z_]+)?)", message)
    if match is None:
        return None
    path = match.group(1)
    for prefix, name in _PARAM_NAMES.items():
        if path == prefix or path.startswith(prefix + "."):
            return name
    if path.startswith(("sampling.", "stop.")):
        return path.split(".", 1)[1]
    return None


class HTTPDeadline:
    """An HTTP request's deadline, in the shape the servicer reads a gRPC context's:
    time_remaining() gives the seconds left (None: no deadline)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self._expires_at = None if seconds is None else time.monotonic() + seconds

    @classmethod
    def of(cls, http_request: Request, default_seconds: float | None) -> HTTPDeadline:
        """The X-Request-Timeout header's deadline, else `default_seconds`."""
        text = http_request.headers.get(TIMEOUT_HEADER)
        if text is None:
            return cls(default_seconds)
        try:
            seconds = float(text)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):
            raise HTTPError(400, f"X-Request-Timeout={text!r} must be a number of seconds > 0",
                            "X-Request-Timeout", "INVALID_ARGUMENT")
        return cls(seconds)

    def time_remaining(self) -> float | None:
        return None if self._expires_at is None else self._expires_at - time.monotonic()

    def expired(self) -> HTTPError:
        return HTTPError(504, f"the request's deadline ({self.seconds:g} s) passed",
                         code="DEADLINE_EXCEEDED")


def create_app(servicer: GenerateServicer, token: str | None = None,
               request_timeout_seconds: float | None = DEFAULT_REQUEST_TIMEOUT_SECONDS
               ) -> FastAPI:
    """The HTTP API over `servicer`; with `token`, /v1 requires 'Authorization: Bearer token'.
    A completion without an X-Request-Timeout header gets `request_timeout_seconds` (None:
    no deadline)."""
    app = FastAPI(title="Tandem", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    api = OpenAIService(servicer, request_timeout_seconds)

    async def require_token(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise HTTPError(401, "missing or wrong bearer token (Authorization: Bearer ...)",
                            code="UNAUTHENTICATED",
                            headers={"WWW-Authenticate": "Bearer"})

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_token)])
    v1.add_api_route("/chat/completions", api.chat_completions, methods=["POST"])
    v1.add_api_route("/completions", api.completions, methods=["POST"])
    v1.add_api_route("/models", api.models, methods=["GET"])
    v1.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    v1.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    app.include_router(v1)
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/version", api.version, methods=["GET"])

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return HTTPError(400, exc.message, exc.param, "INVALID_ARGUMENT").response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    return app


def _validation_error(exc: RequestValidationError) -> HTTPError:
    """A 400 naming the first field pydantic refused."""
    errors = exc.errors()
    if not errors:
        return HTTPError(400, "invalid request body", code="INVALID_ARGUMENT")
    error = errors[0]
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    field = ".".join(loc) or "body"
    if error.get("type") == "extra_forbidden":
        message = f"{field}: unsupported field (Tandem does not implement it)"
    else:
        message = f"{field}: {error.get('msg', 'invalid value')}"
    return HTTPError(400, message, loc[0] if loc else None, "INVALID_ARGUMENT")


class OpenAIService:
    """The endpoints; each completion is one or more `servicer.stream` calls."""

    def __init__(self, servicer: GenerateServicer,
                 request_timeout_seconds: float | None = DEFAULT_REQUEST_TIMEOUT_SECONDS
                 ) -> None:
        self.servicer = servicer
        self.request_timeout_seconds = request_timeout_seconds
        self.model_name = servicer.frontend.limits.name
        self.created = int(time.time())
        self.logprobs = LogprobFormatter(servicer.frontend.tokenizer)

    async def health(self) -> JSONResponse:
        can_serve = self.servicer.pool.can_serve and not self.servicer.is_draining
        return JSONResponse({"status": "ok" if can_serve else "unavailable"},
                            200 if can_serve else 503)

    async def version(self) -> dict:
        return {"version": __version__}

    async def models(self) -> dict:
        """OpenAI's model list, plus what a client needs to build token-id prompts."""
        frontend = self.servicer.frontend
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "tandem", "max_model_len": frontend.limits.max_model_len,
            "vocab_size": frontend.limits.vocab_size,
            "eos_token_ids": list(frontend.eos_token_ids)}]}

    async def tokenize(self, body: TokenizeRequest) -> dict:
        """The prompt's token ids, exactly as a completion with it would count them."""
        request = body.to_generate_request()
        limits = self.servicer.frontend.limits
        try:
            check_request(request, limits)
        except RequestError as exc:
            raise HTTPError.from_request_error(exc) from exc
        ids = await self.servicer.frontend.prompt_token_ids(request)
        return {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        limits = self.servicer.frontend.limits
        if body.model and body.model != limits.name:
            raise HTTPError(404, f"model={body.model!r} is not served here (serving "
                                 f"{limits.name!r})", "model", "NOT_FOUND")
        bad = next((t for t in body.tokens if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise HTTPError(400, f"tokens: {bad} is not in [0, vocab_size="
                                 f"{limits.vocab_size})", "tokens", "INVALID_ARGUMENT")
        return {"prompt": await self.servicer.frontend.text(body.tokens)}

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        body.check()
        return await self._complete(body, "chat", request)

    async def completions(self, body: CompletionRequest, request: Request):
        body.check()
        return await self._complete(body, "text", request)

    async def _complete(self, body, kind: str, http_request: Request):
        deadline = HTTPDeadline.of(http_request, self.request_timeout_seconds)
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        requests = body.to_generate_requests(request_id)
        output = CompletionOutput(kind, request_id, self.model_name, body.n, self.logprobs,
                                  len(requests), body.return_token_ids,
                                  self._tool_calls(body) if kind == "chat" else None)
        streams = [self.servicer.stream(r, deadline) for r in requests]
        if body.stream:
            firsts = await _until_disconnect(http_request, _first_responses(streams), deadline)
            # From here the workers' calls carry the deadline: past it they end with
            # DEADLINE_EXCEEDED, which the stream sends as its error event.
            return StreamingResponse(
                _sse(output, streams, firsts, body.include_usage),
                media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            results = await _until_disconnect(http_request, _run_all(streams), deadline)
        except RequestError as exc:
            raise HTTPError.from_request_error(exc) from exc
        for index, responses in enumerate(results):
            for response in responses:
                output.add(index, response)
        return output.whole()


    def _tool_calls(self, body: ChatCompletionRequest) -> ToolCallParsing | None:
        """How to find tool calls in this chat's answers (None: no tools were offered)."""
        fmt = self.servicer.frontend.limits.tool_call_format
        if not body.tools or body.tool_choice == "none" or fmt is None:
            return None
        return ToolCallParsing(fmt, {tool.function.name for tool in body.tools})


async def _drain(stream) -> list[generate_pb2.GenerateResponse]:
    async with aclosing(stream) as responses:
        return [response async for response in responses]


async def _run_all(streams) -> list[list[generate_pb2.GenerateResponse]]:
    """Every stream to its end, concurrently; the first failure cancels the others."""
    tasks = [asyncio.ensure_future(_drain(stream)) for stream in streams]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until_disconnect(http_request: Request, work, deadline: HTTPDeadline):
    """`await work`, cancelled (the requests aborted on every worker) if the client
    disconnects or the deadline passes first (a 504). The body is already read, so the next
    ASGI message is the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(http_request))
    remaining = deadline.time_remaining()
    try:
        await asyncio.wait((task, watcher), timeout=None if remaining is None
                           else max(0.0, remaining), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        if watcher.done() and not watcher.cancelled():
            raise HTTPError(499, "the client closed the connection", code="CANCELLED")
        raise deadline.expired()
    return task.result()


async def _disconnected(http_request: Request) -> None:
    while (await http_request.receive())["type"] != "http.disconnect":
        pass


async def _first_responses(streams) -> list[generate_pb2.GenerateResponse]:
    """Each stream's first message, before the HTTP status is sent: a request the servicer
    refuses (validation, admission, no worker) gets its own status rather than a 200 stream
    that fails. On a failure every stream is closed (aborted on the workers)."""
    tasks = [asyncio.ensure_future(anext(stream)) for stream in streams]
    try:
        return await asyncio.gather(*tasks)
    except BaseException as exc:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
        if isinstance(exc, RequestError):
            raise HTTPError.from_request_error(exc) from exc
        raise


async def _merged(streams, firsts):
    """(choice index, response) from every stream as they come; closing this generator
    cancels the streams still running."""
    for index, first in enumerate(firsts):
        yield index, first
    if len(streams) == 1:
        async for response in streams[0]:
            yield 0, response
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for response in streams[index]:
                queue.put_nowait((index, response))
            queue.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001 -- re-raised by the consumer
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(index)) for index in range(len(streams))]
    try:
        num_running = len(streams)
        while num_running:
            index, item = await queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _sse(output: CompletionOutput, streams, firsts, include_usage: bool):
    """Server-sent events: chunks, a usage chunk when asked, then [DONE]. A failure after
    the stream started is sent as an error event (the status is already 200)."""
    try:
        for chunk in output.opening_chunks():
            yield _event(chunk)
        async with aclosing(_merged(streams, firsts)) as responses:
            async for index, response in responses:
                chunk = output.add(index, response)
                if chunk is not None:
                    yield _event(chunk)
        if include_usage:
            yield _event(output.usage_chunk())
    except RequestError as exc:
        yield _event(HTTPError.from_request_error(exc).body())
    finally:
        for stream in streams:
            await stream.aclose()
    yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class LogprobFormatter:
    """Token strings (and their UTF-8 bytes) for OpenAI's logprobs objects. A token that is
    part of a multi-byte character decodes to U+FFFD on its own."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._strings: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        text = self._strings.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._strings[token_id] = text
        return text

    def chat(self, logprobs) -> list[dict]:
        entries = []
        for lp in logprobs:
            token = self.token(lp.token_id)
            entries.append({"token": token, "logprob": lp.logprob,
                            "bytes": list(token.encode()),
                            "top_logprobs": [{"token": (t := self.token(top.token_id)),
                                              "logprob": top.logprob,
                                              "bytes": list(t.encode())} for top in lp.top]})
        return entries

    def completion(self, logprobs, text_offset: int) -> dict:
        tokens = [self.token(lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self.token(top.token_id): top.logprob for top in lp.top}
                                 for lp in logprobs],
                "text_offset": offsets}


@dataclass(frozen=True)
class ToolCallParsing:
    """The tool-call format of the model's answers and the tools the request declared."""
    fmt: str
    names: set[str]


class _Choice:
    def __init__(self, tools: ToolCallParsing | None) -> None:
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.text_offset = 0
        self.complete: generate_pb2.Complete | None = None
        self.tool_stream = ToolCallStream(tools.fmt, tools.names) if tools else None
        self.num_calls = 0  # streamed so far


def _tool_call_entries(calls: list[ParsedCall], first_index: int) -> list[dict]:
    return [{"index": first_index + i, "id": ParsedCall.new_id(), "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for i, call in enumerate(calls)]


class CompletionOutput:
    """Builds one completion's OpenAI objects, whole or as chunks, from GenerateResponses."""

    def __init__(self, kind: str, request_id: str, model: str, n: int,
                 logprobs: LogprobFormatter, num_choices: int,
                 return_token_ids: bool = False, tools: ToolCallParsing | None = None) -> None:
        self.kind = kind  # "chat" or "text"
        self.tools = tools
        self.return_token_ids = return_token_ids
        self.request_id = request_id
        self.model = model
        self.n = n
        self.formatter = logprobs
        self.created = int(time.time())
        self.choices = [_Choice(tools) for _ in range(num_choices)]

    def _object(self, suffix: str = "") -> dict:
        kind = "chat.completion" if self.kind == "chat" else "text_completion"
        if self.kind == "chat":
            kind += suffix
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.model}

    def opening_chunks(self) -> list[dict]:
        """Chat streams start with each choice's role; text streams need no opening."""
        if self.kind != "chat":
            return []
        return [{**self._object(".chunk"), "choices": [{
            "index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}]} for index in range(len(self.choices))]

    def add(self, index: int, response: generate_pb2.GenerateResponse) -> dict | None:
        """Records `response`; returns the chunk that streams it (None: nothing to send)."""
        choice = self.choices[index]
        if response.HasField("complete"):
            choice.complete = response.complete
            finish = finish_reason_from_proto(response.complete.finish_reason)
            text, calls = choice.tool_stream.finish() if choice.tool_stream else ("", [])
            return self._chunk(index, text, None, self._finish(choice, finish, calls),
                               tool_calls=self._stream_calls(choice, calls))
        chunk = response.chunk
        choice.texts.append(chunk.text)
        choice.token_ids.extend(chunk.token_ids)
        choice.logprobs.extend(chunk.logprobs)
        logprobs = None
        if chunk.logprobs:
            if self.kind == "chat":
                logprobs = {"content": self.formatter.chat(chunk.logprobs)}
            else:
                logprobs = self.formatter.completion(chunk.logprobs, choice.text_offset)
        choice.text_offset += len(chunk.text)
        token_ids = list(chunk.token_ids) if self.return_token_ids else None
        text, calls = choice.tool_stream.feed(chunk.text) if choice.tool_stream \
            else (chunk.text, [])
        if not text and not calls and logprobs is None and not token_ids:
            return None
        return self._chunk(index, text, logprobs, None, token_ids,
                           self._stream_calls(choice, calls))

    @staticmethod
    def _stream_calls(choice: _Choice, calls: list[ParsedCall]) -> list[dict]:
        entries = _tool_call_entries(calls, choice.num_calls)
        choice.num_calls += len(calls)
        return entries

    @staticmethod
    def _finish(choice: _Choice, finish: str, calls: list) -> str:
        """OpenAI's "tool_calls" when the answer ended by itself after making calls."""
        return "tool_calls" if finish == "stop" and (choice.num_calls or calls) else finish

    def _chunk(self, index: int, text: str, logprobs, finish: str | None,
               token_ids: list[int] | None = None,
               tool_calls: list[dict] | None = None) -> dict:
        if self.kind == "chat":
            delta = {"content": text} if text else {}
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta,
                      "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs,
                      "finish_reason": finish}
        if self.return_token_ids:
            choice["token_ids"] = token_ids or []
        return {**self._object(".chunk"), "choices": [choice]}

    def usage(self) -> dict:
        """Prompt and cached tokens count once per prompt (the first of its n choices)."""
        completes = [c.complete for c in self.choices if c.complete is not None]
        firsts = [c.complete for i, c in enumerate(self.choices)
                  if i % self.n == 0 and c.complete is not None]
        prompt = sum(c.usage.prompt_tokens for c in firsts)
        completion = sum(c.usage.completion_tokens for c in completes)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {
                    "cached_tokens": sum(c.usage.cached_prompt_tokens for c in firsts)}}

    def usage_chunk(self) -> dict:
        return {**self._object(".chunk"), "choices": [], "usage": self.usage()}

    def whole(self) -> dict:
        choices = []
        for index, choice in enumerate(self.choices):
            text = "".join(choice.texts)
            finish = finish_reason_from_proto(choice.complete.finish_reason)
            if self.kind == "chat":
                logprobs = {"content": self.formatter.chat(choice.logprobs)} \
                    if choice.logprobs else None
                message = {"role": "assistant", "content": text}
                if self.tools is not None:
                    content, calls = parse_tool_calls(self.tools.fmt, text, self.tools.names)
                    if calls:
                        message = {"role": "assistant", "content": content.strip() or None,
                                   "tool_calls": _tool_call_entries(calls, 0)}
                        finish = self._finish(choice, finish, calls)
                        for entry in message["tool_calls"]:
                            del entry["index"]  # only deltas carry one
                choices.append({"index": index, "message": message,
                                "logprobs": logprobs, "finish_reason": finish})
            else:
                logprobs = self.formatter.completion(choice.logprobs, 0) \
                    if choice.logprobs else None
                choices.append({"index": index, "text": text, "logprobs": logprobs,
                                "finish_reason": finish})
            if self.return_token_ids:
                choices[-1]["token_ids"] = choice.token_ids
        return {**self._object(), "choices": choices, "usage": self.usage()}

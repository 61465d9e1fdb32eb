"""Checks a GenerateRequest before any worker sees it. Every failure names the field.

Two phases: `check_request` needs only the message (cheap, on the event loop);
`resolve_params` needs the prompt's length, known after tokenization.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import grpc

from tandem.common.convert import structured_output_from_proto
from tandem.common.sampling_params import MAX_LOGPROBS, SamplingParams
from tandem.common.structured_output import StructuredOutput
from tandem.router.tool_calls import NAME_PATTERN
from tandem.v1 import generate_pb2

DEFAULT_MAX_TOKENS = 256
CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
# A prompt longer than max_model_len * this many characters cannot fit: tokenizers average
# 3-5 characters per token on prose, and only long runs of one character pack many more. The
# bound is checked before tokenizing, which for a huge prompt costs far more than the check.
MAX_CHARS_PER_TOKEN = 16
# SamplingParams field -> the request field a client set.
_FIELD_PATHS = {"max_tokens": "stop.max_tokens", "min_tokens": "stop.min_tokens",
                "stop_token_ids": "stop.stop_token_ids", "logprobs": "logprobs"}


class RequestError(Exception):
    """A bad request: becomes a gRPC status with this code, message and trailing metadata
    (e.g. a retry hint)."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 trailing_metadata: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailing_metadata = trailing_metadata


@dataclass(frozen=True, slots=True)
class ModelLimits:
    name: str
    vocab_size: int
    max_model_len: int
    has_chat_template: bool
    tool_call_format: str | None = None  # router/tool_calls.py; None: the template has no tools


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def check_request(request: generate_pb2.GenerateRequest, limits: ModelLimits) -> None:
    """Everything that can be checked before tokenization, sizes first: each check costs
    time linear in what it looks at, bounded by the limits checked before it."""
    if request.model and request.model != limits.name:
        raise RequestError(grpc.StatusCode.NOT_FOUND,
                           f"model={request.model!r} is not served here (serving "
                           f"{limits.name!r})")
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise _invalid("prompt: one of text, token_ids or chat is required")
    if kind == "text":
        if not request.text:
            raise _invalid("text: the prompt is empty")
        _check_num_chars("text", len(request.text), limits)
    if kind == "token_ids":
        ids = request.token_ids.ids
        if not ids:
            raise _invalid("token_ids.ids: the prompt is empty")
        if len(ids) >= limits.max_model_len:
            raise RequestError(grpc.StatusCode.OUT_OF_RANGE,
                               f"token_ids.ids has {len(ids)} tokens; max_model_len="
                               f"{limits.max_model_len} leaves no room to generate")
        for i, token in enumerate(ids):
            if not 0 <= token < limits.vocab_size:
                raise RequestError(grpc.StatusCode.OUT_OF_RANGE,
                                   f"token_ids.ids[{i}]={token} is outside the vocabulary "
                                   f"[0, {limits.vocab_size})")
    if kind == "chat":
        _check_chat(request.chat, limits)
        if request.chat.tool_choice not in ("", "auto", "none") \
                and request.HasField("structured_output"):
            raise _invalid(f"structured_output: chat.tool_choice={request.chat.tool_choice!r} "
                           "already decides the answer's shape; give one of them")
    stop = request.stop
    if len(stop.stop) > MAX_STOP_STRINGS:
        raise _invalid(f"stop.stop: at most {MAX_STOP_STRINGS} stop strings")
    for i, text in enumerate(stop.stop):
        if not text:
            raise _invalid(f"stop.stop[{i}] is empty")
        if len(text) > MAX_STOP_STRING_CHARS:
            raise _invalid(f"stop.stop[{i}] has {len(text)} characters; at most "
                           f"{MAX_STOP_STRING_CHARS} per stop string")
    for i, token in enumerate(stop.stop_token_ids):
        if not 0 <= token < limits.vocab_size:
            raise RequestError(grpc.StatusCode.OUT_OF_RANGE,
                               f"stop.stop_token_ids[{i}]={token} is outside the vocabulary "
                               f"[0, {limits.vocab_size})")
    if stop.HasField("max_tokens") and stop.max_tokens < 1:
        raise _invalid(f"stop.max_tokens={stop.max_tokens} must be >= 1")
    if request.HasField("logprobs") and not 0 <= request.logprobs <= MAX_LOGPROBS:
        raise _invalid(f"logprobs={request.logprobs} must be in [0, {MAX_LOGPROBS}]")
    for field, value in request.sampling.ListFields():
        if isinstance(value, float) and not math.isfinite(value):
            raise _invalid(f"sampling.{field.name}={value} must be a finite number")
    structured_output(request)


def structured_output(request: generate_pb2.GenerateRequest) -> StructuredOutput | None:
    """The request's output spec (None: free text); INVALID_ARGUMENT when it is malformed.
    Whether it compiles is checked separately (`grammar_error`, off the event loop)."""
    if not request.HasField("structured_output"):
        return None
    try:
        return structured_output_from_proto(request.structured_output)
    except ValueError as exc:
        raise _invalid(str(exc)) from exc


def _check_num_chars(field: str, num_chars: int, limits: ModelLimits) -> None:
    max_chars = limits.max_model_len * MAX_CHARS_PER_TOKEN
    if num_chars > max_chars:
        raise RequestError(grpc.StatusCode.OUT_OF_RANGE,
                           f"{field} has {num_chars} characters; max_model_len="
                           f"{limits.max_model_len} tokens allows at most {max_chars} "
                           f"({MAX_CHARS_PER_TOKEN} characters per token)")


def _check_chat(chat: generate_pb2.ChatMessages, limits: ModelLimits) -> None:
    if not limits.has_chat_template:
        raise _invalid(f"chat: model {limits.name!r} has no chat template; send text or "
                       "token_ids")
    if not chat.messages:
        raise _invalid("chat.messages: at least one message is required")
    if len(chat.messages) > limits.max_model_len:  # every message takes a token or more
        raise RequestError(grpc.StatusCode.OUT_OF_RANGE,
                           f"chat.messages has {len(chat.messages)} messages; max_model_len="
                           f"{limits.max_model_len} tokens cannot hold them")
    _check_num_chars("chat.messages and chat.tools (all contents together)",
                     sum(len(m.content) + sum(len(c.arguments_json) for c in m.tool_calls)
                         for m in chat.messages)
                     + sum(len(t.description) + len(t.parameters_json) for t in chat.tools),
                     limits)
    for i, message in enumerate(chat.messages):
        if message.role not in CHAT_ROLES:
            raise _invalid(f"chat.messages[{i}].role={message.role!r} is not one of "
                           f"{', '.join(CHAT_ROLES)}")
        if message.tool_calls and message.role != "assistant":
            raise _invalid(f"chat.messages[{i}].tool_calls: only an assistant turn makes calls")
        for j, call in enumerate(message.tool_calls):
            if not call.name:
                raise _invalid(f"chat.messages[{i}].tool_calls[{j}].name is empty")
            _json_object(f"chat.messages[{i}].tool_calls[{j}].arguments_json",
                         call.arguments_json)
        if message.tool_call_id and message.role != "tool":
            raise _invalid(f"chat.messages[{i}].tool_call_id: only a tool turn answers a call")
    _check_tools(chat, limits)


def _check_tools(chat: generate_pb2.ChatMessages, limits: ModelLimits) -> None:
    choice = chat.tool_choice
    if not chat.tools and not choice and not chat.HasField("parallel_tool_calls"):
        return
    names = [tool.name for tool in chat.tools]
    if chat.tools and limits.tool_call_format is None:
        raise _invalid(f"chat.tools: model {limits.name!r} has a chat template that renders "
                       "no tools, so the model would never see them")
    for i, tool in enumerate(chat.tools):
        if not NAME_PATTERN.fullmatch(tool.name):
            raise _invalid(f"chat.tools[{i}].name={tool.name[:80]!r} must be 1-64 letters, "
                           "digits, '_' or '-'")
        if names.index(tool.name) != i:
            raise _invalid(f"chat.tools[{i}].name={tool.name!r} is declared twice")
        if tool.parameters_json:
            schema = _json_object(f"chat.tools[{i}].parameters_json", tool.parameters_json)
            if schema.get("type", "object") != "object":
                raise _invalid(f"chat.tools[{i}].parameters_json must be an object schema "
                               f"(type 'object', not {schema['type']!r})")
    if choice not in ("", "auto", "none", "required") and choice not in names:
        raise _invalid(f"chat.tool_choice={choice[:80]!r} is not auto, none, required or a "
                       "declared tool's name")
    if choice == "required" and not chat.tools:
        raise _invalid("chat.tool_choice=required needs chat.tools")


def _json_object(field: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise _invalid(f"{field} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise _invalid(f"{field} must be a JSON object")
    return value


def resolve_params(request: generate_pb2.GenerateRequest, num_prompt_tokens: int,
                   limits: ModelLimits) -> SamplingParams:
    """The engine parameters, given the tokenized prompt's length."""
    room = limits.max_model_len - num_prompt_tokens
    if room < 1:
        raise RequestError(grpc.StatusCode.OUT_OF_RANGE,
                           f"prompt has {num_prompt_tokens} tokens; max_model_len="
                           f"{limits.max_model_len} leaves no room to generate")
    stop, sampling = request.stop, request.sampling
    max_tokens = min(stop.max_tokens if stop.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
                     room)
    values = {"max_tokens": max_tokens,
              "min_tokens": min(stop.min_tokens, max_tokens) if stop.min_tokens >= 0
              else stop.min_tokens,
              "stop_token_ids": tuple(stop.stop_token_ids), "ignore_eos": stop.ignore_eos,
              "logprobs": request.logprobs if request.HasField("logprobs") else None}
    for field, value in sampling.ListFields():
        values[field.name] = value
    values["structured_output"] = structured_output(request)
    try:
        return SamplingParams(**values)
    except ValueError as exc:  # "SamplingParams.top_p=1.5 must be in (0, 1]"
        message = str(exc)
        match = re.match(r"SamplingParams\.(\w+)", message)
        if match:
            name = match.group(1)
            message = _FIELD_PATHS.get(name, f"sampling.{name}") + message[match.end():]
        raise _invalid(message) from exc

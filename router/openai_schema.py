"""The OpenAI request bodies the HTTP API accepts, and their translation to GenerateRequests.

Every model forbids fields it does not declare: a field Tandem does not implement
(`logit_bias`, `functions`, ...) is refused with a 400 naming it rather than dropped.
Values are checked where the gRPC path checks them (router/validation.py), so both transports
give one verdict; here only the shapes, and what exists only in the OpenAI API (`n`, the
pairing of `logprobs` and `top_logprobs`), are checked.

`n` > 1 runs n requests through the same path. With a `seed`, choice i uses seed + i: each
choice is reproducible and the choices differ from one another.

`response_format` becomes the request's structured_output: `json_object` any JSON object,
`json_schema` its `schema` (an absent schema: any JSON value). The schema is enforced by a
grammar whether or not `strict` is set, so a completion that is not cut short by max_tokens
always parses and validates.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from tandem.v1 import generate_pb2

MAX_N = 16  # choices per prompt


class OpenAIError(Exception):
    """A request the HTTP layer refuses before it reaches the servicer (always a 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: str
    # None only on an assistant turn that made tool calls.
    content: Union[str, list[TextPart], None] = None
    name: str | None = None  # accepted; the chat templates Tandem serves do not use it
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def to_proto(self) -> generate_pb2.ChatMessage:
        message = generate_pb2.ChatMessage(role=self.role, content=self.text,
                                           tool_call_id=self.tool_call_id or "")
        message.tool_calls.extend(
            generate_pb2.ToolCall(id=call.id, name=call.function.name,
                                  arguments_json=call.function.arguments)
            for call in self.tool_calls or [])
        return message


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # accepted: required and named tool choices are always strict


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # accepted; the schema is enforced either way


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def to_proto(self) -> generate_pb2.StructuredOutput | None:
        """The structured_output this format asks for (None: free text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return generate_pb2.StructuredOutput(json_object=generate_pb2.JsonObject())
        if self.json_schema is None:
            raise OpenAIError("response_format", "response_format.json_schema is required "
                                                 "when type is json_schema")
        schema = self.json_schema.json_schema if self.json_schema.json_schema is not None \
            else {}
        return generate_pb2.StructuredOutput(json_schema=json.dumps(schema))


class _CommonRequest(_Strict):
    """The fields chat and text completions share; None means 'the router's default'."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, not used
    # Extras that vLLM and SGLang accept too.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    # Each choice (and each streamed chunk) also carries the ids of the tokens it adds, as
    # vLLM's extra of this name does: clients that count tokens per chunk (tandem bench) need
    # them, and a chunk whose text is held back still reports its tokens.
    return_token_ids: bool = False

    def check(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise OpenAIError("n", f"n={self.n} must be in [1, {MAX_N}]")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options", "stream_options is only allowed with "
                                                "stream=true")
        if self.seed is not None and not 0 <= self.seed < 2**64 - MAX_N:
            raise OpenAIError("seed", f"seed={self.seed} must be in [0, 2**64 - {MAX_N})")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _fill(self, message: generate_pb2.GenerateRequest, max_tokens: int | None,
              choice: int) -> None:
        """Copies the shared fields into `message`; choice i gets seed + i."""
        message.model = self.model or ""
        sampling = message.sampling
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k",
                     "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                setattr(sampling, name, value)
        if self.seed is not None:
            sampling.seed = self.seed + choice
        stop = message.stop
        if max_tokens is not None:
            stop.max_tokens = max_tokens
        if self.min_tokens is not None:
            stop.min_tokens = self.min_tokens
        stop.stop.extend([self.stop] if isinstance(self.stop, str) else self.stop or [])
        stop.stop_token_ids.extend(self.stop_token_ids or [])
        stop.ignore_eos = self.ignore_eos
        structured = self.response_format.to_proto() if self.response_format else None
        if structured is not None:
            message.structured_output.CopyFrom(structured)


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        super().check()
        for i, message in enumerate(self.messages):
            if message.content is None and not (message.role == "assistant"
                                                and message.tool_calls):
                raise OpenAIError(f"messages[{i}].content", "content is required (it may be "
                                  "null only on an assistant message with tool_calls)")
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("top_logprobs", "top_logprobs needs logprobs=true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise OpenAIError("max_completion_tokens", "max_tokens and max_completion_tokens "
                                                       "differ; give one")

    def to_generate_requests(self, request_id: str) -> list[generate_pb2.GenerateRequest]:
        """The n GenerateRequests of this chat completion, in choice order."""
        requests = []
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        for choice in range(self.n):
            message = generate_pb2.GenerateRequest(request_id=f"{request_id}-{choice}")
            message.chat.messages.extend(m.to_proto() for m in self.messages)
            self._fill_tools(message.chat)
            self._fill(message, max_tokens, choice)
            if self.logprobs:
                message.logprobs = self.top_logprobs or 0
            requests.append(message)
        return requests

    def _fill_tools(self, chat: generate_pb2.ChatMessages) -> None:
        for tool in self.tools or []:
            function = tool.function
            chat.tools.add(name=function.name, description=function.description or "",
                           parameters_json=json.dumps(function.parameters)
                           if function.parameters is not None else "")
        if isinstance(self.tool_choice, NamedToolChoice):
            chat.tool_choice = self.tool_choice.function.name
        elif self.tool_choice is not None:
            chat.tool_choice = self.tool_choice
        if self.parallel_tool_calls is not None:
            chat.parallel_tool_calls = self.parallel_tool_calls


Prompt = Union[str, list[int], list[str], list[list[int]]]


class CompletionRequest(_CommonRequest):
    prompt: Prompt
    logprobs: int | None = None

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [prompt]
        return list(prompt) or [[]]  # an empty list: one empty prompt, refused downstream

    def to_generate_requests(self, request_id: str) -> list[generate_pb2.GenerateRequest]:
        """n GenerateRequests per prompt: choice index = prompt index * n + sample."""
        requests = []
        for i, prompt in enumerate(self.prompts):
            for sample in range(self.n):
                index = i * self.n + sample
                message = generate_pb2.GenerateRequest(request_id=f"{request_id}-{index}")
                if isinstance(prompt, str):
                    message.text = prompt
                else:
                    message.token_ids.ids.extend(prompt)
                self._fill(message, self.max_tokens, sample)
                if self.logprobs is not None:
                    message.logprobs = self.logprobs
                requests.append(message)
        return requests


class TokenizeRequest(_Strict):
    """/v1/tokenize: a text prompt or chat messages, tokenized as a completion would be."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None

    def to_generate_request(self) -> generate_pb2.GenerateRequest:
        if (self.prompt is None) == (self.messages is None):
            raise OpenAIError("prompt", "give one of prompt or messages")
        message = generate_pb2.GenerateRequest(model=self.model or "")
        if self.prompt is not None:
            message.text = self.prompt
        else:
            message.chat.messages.extend(generate_pb2.ChatMessage(role=m.role, content=m.text)
                                         for m in self.messages)
        return message


class DetokenizeRequest(_Strict):
    """/v1/detokenize: token ids back to text."""
    model: str | None = None
    tokens: list[int]

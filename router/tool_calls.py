"""Tool calls in a model's answer: which format its chat template asks for, the calls parsed
back out of the text (whole, or as it streams), and the grammar that forces a call.

Formats, named after the model families that use them:
- "hermes": each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
  text outside the blocks is the answer's content (Qwen2.5, Qwen3, Hermes and others).
- "llama3-json": the whole answer is `{"name": ..., "parameters": {...}}`, several calls
  separated by ";" (Llama 3.1 / 3.2 with their JSON tool-calling template).
The format comes from the chat template's text; a template that does not render tools has none,
and a request with tools is refused for it rather than sent to a model that never sees them.

A block that does not parse as a call (bad JSON, unknown shape) stays in the content, so no text
the model wrote is lost. The grammar for tool_choice "required" or a named tool accepts exactly
the format's calls with arguments valid against each tool's parameter schema (llguidance's Lark
dialect with `%json` schemas); the engine stops when it is complete.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Sequence

HERMES = "hermes"
LLAMA3_JSON = "llama3-json"
FORMATS = (HERMES, LLAMA3_JSON)
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the request declares it; `parameters` is a JSON Schema (a dict)."""
    name: str
    description: str
    parameters: dict

    def as_template_tool(self) -> dict:
        """The OpenAI shape chat templates expect in their `tools` variable."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text

    @staticmethod
    def new_id() -> str:
        return f"call_{uuid.uuid4().hex[:24]}"


def detect_format(chat_template: str | None) -> str | None:
    """The tool-call format `chat_template` asks the model for; None when it renders no tools."""
    if not chat_template or "tools" not in chat_template:
        return None
    if _HERMES_OPEN in chat_template:
        return HERMES
    if _PYTHON_TAG in chat_template or '"parameters"' in chat_template:
        return LLAMA3_JSON
    return None


def _call_of(payload: str, arguments_key: str, names: set[str] | None) -> ParsedCall | None:
    try:
        value = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if not isinstance(arguments, dict) or (names is not None and value["name"] not in names):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(fmt: str, text: str, names: set[str] | None = None
                     ) -> tuple[str, list[ParsedCall]]:
    """(content, calls) of a whole answer. `names`: the declared tools (a call to another name
    stays content)."""
    stream = ToolCallStream(fmt, names)
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    return content + rest, calls + more


class ToolCallStream:
    """Splits an answer arriving in pieces into content and calls, holding back only text that
    may still turn out to be part of a call. feed() and finish() return (content, calls) to send
    now; everything fed comes out exactly once, as content or inside a call."""

    def __init__(self, fmt: str, names: set[str] | None = None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(FORMATS)}")
        self.fmt = fmt
        self.names = names
        self._buffer = ""
        self._decided: bool | None = None  # llama3-json: is the answer JSON?

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._buffer += text
        if self.fmt == HERMES:
            return self._hermes(final=False)
        return self._llama3(final=False)

    def finish(self) -> tuple[str, list[ParsedCall]]:
        if self.fmt == HERMES:
            return self._hermes(final=True)
        return self._llama3(final=True)

    def _hermes(self, final: bool) -> tuple[str, list[ParsedCall]]:
        # Whitespace right before a block is nobody's content (the newline between two calls),
        # so trailing whitespace waits in the buffer until what follows it is known.
        content, calls = [], []
        while True:
            start = self._buffer.find(_HERMES_OPEN)
            end = self._buffer.find(_HERMES_CLOSE, start) if start >= 0 else -1
            if final and end < 0:  # no further block: the rest is content
                content.append(self._buffer)
                self._buffer = ""
                break
            if end < 0:
                if start < 0:
                    start = len(self._buffer) - _partial_suffix(self._buffer, _HERMES_OPEN)
                ready = len(self._buffer[:start].rstrip())
                content.append(self._buffer[:ready])
                self._buffer = self._buffer[ready:]
                break
            block_end = end + len(_HERMES_CLOSE)
            call = _call_of(self._buffer[start + len(_HERMES_OPEN):end], "arguments", self.names)
            if call is None:
                content.append(self._buffer[:block_end])
            else:
                content.append(self._buffer[:start].rstrip())
                calls.append(call)
            self._buffer = self._buffer[block_end:]
        return "".join(content), calls

    def _llama3(self, final: bool) -> tuple[str, list[ParsedCall]]:
        if self._decided is None:
            stripped = self._buffer.lstrip()
            if stripped.startswith(_PYTHON_TAG) or stripped.startswith("{"):
                self._decided = True
            elif stripped and not _PYTHON_TAG.startswith(stripped):
                self._decided = False
        if self._decided is False or (self._decided is None and final):
            text, self._buffer = self._buffer, ""
            return text, []
        if not final:
            return "", []
        text, self._buffer = self._buffer, ""
        payload = text.strip().removeprefix(_PYTHON_TAG)
        calls = []
        for part in _split_top_level(payload, ";"):
            call = _call_of(part, "parameters", self.names)
            if call is None:
                return text, []  # all or nothing: a half-parsed answer is content
            calls.append(call)
        return "", calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _split_top_level(text: str, separator: str) -> list[str]:
    """`text` split at `separator`s outside JSON strings, objects and arrays."""
    parts, depth, in_string, escaped, start = [], 0, False, False, 0
    for position, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == separator and depth == 0:
            parts.append(text[start:position])
            start = position + 1
    parts.append(text[start:])
    return [part.strip() for part in parts if part.strip()]


def call_grammar(fmt: str, tools: Sequence[ToolSpec], parallel: bool,
                 single_tokens: set[str] = frozenset()) -> str:
    """A Lark grammar (llguidance's dialect) accepting one call -- or several when `parallel`
    -- to one of `tools`, in `fmt`, with arguments valid against the tool's parameters.
    `single_tokens`: markers the tokenizer has as one token of their own (written as tokens,
    so the model must use that token rather than spelling the marker out)."""
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    arguments_key = "arguments" if fmt == HERMES else "parameters"
    schema = {"anyOf": [{
        "type": "object",
        "properties": {"name": {"const": tool.name},
                       arguments_key: tool.parameters or {"type": "object"}},
        "required": ["name", arguments_key], "additionalProperties": False}
        for tool in tools],
        # At most one space between JSON tokens: the templates' own style (`"name": "f"`) or
        # compact, never a run of blanks a model could spend its tokens on.
        "x-guidance": {"whitespace_pattern": " ?"}}
    if fmt == HERMES:
        opener, closer = (marker if marker in single_tokens else json.dumps(marker)
                          for marker in (_HERMES_OPEN, _HERMES_CLOSE))
        call = f'{opener} "\\n" call_json "\\n" {closer}'
        joiner = '"\\n"'
    elif fmt == LLAMA3_JSON:
        call, joiner = "call_json", '"; "'
    else:
        raise ValueError(f"unknown tool-call format {fmt!r}")
    start = f"start: call ({joiner} call)*" if parallel else "start: call"
    return (f"{start}\ncall: {call}\n"
            f"call_json: %json {json.dumps(schema, separators=(',', ':'))}\n")


def single_token_markers(tokenizer) -> set[str]:
    """The call markers `tokenizer` encodes as one token (Qwen's <tool_call>, for one)."""
    found = set()
    for marker in (_HERMES_OPEN, _HERMES_CLOSE):
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1:
            found.add(marker)
    return found

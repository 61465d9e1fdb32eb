"""The served model as the router sees it: tokenizer, chat template and limits.

Tokenizing and applying chat templates run in a thread pool, off the event loop.
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tandem.common.checkpoint_files import eos_token_ids
from tandem.common.structured_output import StructuredOutput, grammar_error
from tandem.router.tool_calls import (ToolSpec, call_grammar, detect_format,
                                      single_token_markers)
from tandem.router.validation import ModelLimits
from tandem.v1 import generate_pb2


class ModelFrontend:
    def __init__(self, model_path: str | Path, max_model_len: int | None = None,
                 num_threads: int = 2) -> None:
        from transformers import AutoTokenizer

        path = Path(model_path)
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {path / 'config.json'}: {exc}") from exc
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:
            raise ValueError(f"cannot load the tokenizer in {path}: {exc}") from exc
        model_limit = config.get("max_position_embeddings")
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates ("default", "tool_use", ...)
            template = "\n".join(template.values())
        self.limits = ModelLimits(
            name=path.name, vocab_size=int(config["vocab_size"]),
            max_model_len=int(max_model_len or model_limit),
            has_chat_template=bool(template), tool_call_format=detect_format(template))
        # Call markers written as one token in forcing grammars (router/tool_calls.py).
        self.tool_call_markers = single_token_markers(self.tokenizer)
        self.architectures = list(config.get("architectures") or [])
        self.eos_token_ids = sorted(eos_token_ids(path, config.get("eos_token_id")))
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="tokenize")

    async def prompt_token_ids(self, request: generate_pb2.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        loop = asyncio.get_running_loop()
        if kind == "text":
            return await loop.run_in_executor(self._executor, self._encode, request.text)
        messages, tools = template_inputs(request.chat)
        return await loop.run_in_executor(self._executor, self._apply_chat_template, messages,
                                          tools)

    async def structured_output_error(self, spec: StructuredOutput) -> str | None:
        """Why the spec does not compile (None: it does), checked on the thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, grammar_error, spec)

    async def text(self, token_ids: list[int]) -> str:
        """The text of `token_ids` (ids checked against the vocabulary by the caller)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.tokenizer.decode, token_ids)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def _apply_chat_template(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tools=tools,
                                                 add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)

    def tool_call_grammar(self, chat: generate_pb2.ChatMessages) -> str | None:
        """The grammar that enforces tool_choice "required" or a named tool on a validated
        request (None for auto and none: the model decides)."""
        if chat.tool_choice in ("", "auto", "none"):
            return None
        tools = [tool_spec(t) for t in chat.tools if chat.tool_choice in ("required", t.name)]
        parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
        return call_grammar(self.limits.tool_call_format, tools, parallel,
                            self.tool_call_markers)

    def model_info(self) -> generate_pb2.GetModelInfoResponse:
        return generate_pb2.GetModelInfoResponse(
            model=self.limits.name, architectures=self.architectures,
            max_model_len=self.limits.max_model_len, vocab_size=self.limits.vocab_size,
            eos_token_ids=self.eos_token_ids, has_chat_template=self.limits.has_chat_template)

    def close(self) -> None:
        self._executor.shutdown(wait=False)


def template_inputs(chat: generate_pb2.ChatMessages) -> tuple[list[dict], list[dict] | None]:
    """The chat template's `messages` and `tools` for a chat prompt, in the OpenAI shapes the
    templates expect (a call's arguments as a mapping). tool_choice "none" offers no tools."""
    messages = []
    for m in chat.messages:
        message = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": json.loads(c.arguments_json)}}
                for c in m.tool_calls]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    if not chat.tools or chat.tool_choice == "none":
        return messages, None
    return messages, [tool_spec(t).as_template_tool() for t in chat.tools]


def tool_spec(tool: generate_pb2.Tool) -> ToolSpec:
    """A validated request's tool (its parameters JSON already checked to be an object)."""
    parameters = json.loads(tool.parameters_json) if tool.parameters_json else \
        {"type": "object", "properties": {}}
    return ToolSpec(tool.name, tool.description, parameters)


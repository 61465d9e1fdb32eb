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
        self.limits = ModelLimits(
            name=path.name, vocab_size=int(config["vocab_size"]),
            max_model_len=int(max_model_len or model_limit),
            has_chat_template=bool(getattr(self.tokenizer, "chat_template", None)))
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
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        return await loop.run_in_executor(self._executor, self._apply_chat_template, messages)

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

    def _apply_chat_template(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)

    def model_info(self) -> generate_pb2.GetModelInfoResponse:
        return generate_pb2.GetModelInfoResponse(
            model=self.limits.name, architectures=self.architectures,
            max_model_len=self.limits.max_model_len, vocab_size=self.limits.vocab_size,
            eos_token_ids=self.eos_token_ids, has_chat_template=self.limits.has_chat_template)

    def close(self) -> None:
        self._executor.shutdown(wait=False)

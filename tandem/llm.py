"""Offline API: run the engine in this process.

    llm = LLM(model="/path/to/hf_dir", dtype="float32", max_model_len=2048)
    [out] = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    out.text, out.token_ids, out.finish_reason

With tensor_parallel_size=N the model is split over this process (rank 0) and N - 1 follower
processes it starts; `llm.shutdown()` (or leaving a `with LLM(...) as llm:` block, or this
object being collected, or the interpreter exiting) stops them. One such LLM per process.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.common.logging import get_logger
from tandem.common.sampling_params import SamplingParams
from tandem.workers.engine.config import EngineConfig
from tandem.workers.engine.engine import LLMEngine
from tandem.workers.executor.executor import build_executor
from tandem.workers.engine.sequence import Sequence, TokenLogprob

logger = get_logger(__name__)

Prompt = str | list[int]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only
    text: str  # the generated tokens decoded ("" when the model folder has no tokenizer)
    finish_reason: str  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprob] | None  # one per generated token, when asked for
    num_cached_tokens: int  # prompt tokens served from the prefix cache at the last admission


class LLM:
    """A whole engine in this process. Keyword arguments are EngineConfig fields."""

    def __init__(self, model: str | Path, **engine_args: Any) -> None:
        config = EngineConfig(model=str(model), **engine_args)
        self.engine = LLMEngine(config, build_executor(config))
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        try:
            self.tokenizer = _load_tokenizer(Path(model))
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop the follower ranks of a tensor-parallel engine (no-op on one rank)."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} "
                             "prompts")
        token_lists = [self._tokenize(p, i) for i, p in enumerate(prompts)]
        seqs: list[Sequence] = []
        try:
            for ids, params in zip(token_lists, sampling_params):
                seqs.append(self.engine.add_request(ids, params))
        except ValueError as exc:
            self._abort(seqs)
            raise ValueError(f"prompt {len(seqs)}: {exc}") from exc
        for index, seq in enumerate(seqs):  # a grammar that cannot compile fails the call
            failure = seq.grammar.compiled.exception() if seq.grammar is not None else None
            if failure is not None:
                self._abort(seqs)
                raise ValueError(f"prompt {index}: {failure}")
        while self.engine.has_unfinished:
            self.engine.step()
        return [self._output(seq) for seq in seqs]

    def _abort(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.engine.abort(seq.request_id)

    def _tokenize(self, prompt: Prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {index} is text but the model folder has no "
                                 "tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, SequenceABC) or not all(isinstance(t, int) for t in prompt):
            raise ValueError(f"prompt {index} must be a string or a list of token ids")
        return list(prompt)

    def _output(self, seq: Sequence) -> RequestOutput:
        completion = seq.completion_token_ids
        text = self.tokenizer.decode(completion, skip_special_tokens=True) \
            if self.tokenizer is not None else ""
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
            token_ids=completion, text=text, finish_reason=seq.finish_reason.value,
            logprobs=list(seq.logprobs) if seq.sampling_params.logprobs is not None else None,
            num_cached_tokens=seq.num_prefix_hit_tokens)


def _load_tokenizer(model_path: Path):
    if not any((model_path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    except Exception as exc:
        raise ValueError(f"cannot load the tokenizer in {model_path}: {exc}") from exc

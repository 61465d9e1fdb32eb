"""What the benchmark sends: length distributions, synthetic prompts and JSONL prompt files.

A workload is an endless iterator of RequestSpec, drawn in issue order from one seeded numpy
generator, so the same seed gives the same requests whatever the load shape or the timing.
"""
from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["FilePrompt", "LengthDist", "RequestSpec", "file_workload", "read_prompts_file",
           "synthetic_workload"]


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A distribution of token counts, parsed from "N", "uniform:A:B" or "normal:MU:SIGMA".

    fixed: always `a`. uniform: an integer in [a, b], both ends included. normal: a normal draw
    with mean `a` and standard deviation `b`, rounded to the nearest integer and clipped to >= 1.
    """
    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str, name: str = "length") -> LengthDist:
        parts = str(text).strip().split(":")
        try:
            if len(parts) == 1:
                dist = cls("fixed", int(parts[0]))
            elif len(parts) == 3 and parts[0] == "uniform":
                dist = cls("uniform", int(parts[1]), int(parts[2]))
            elif len(parts) == 3 and parts[0] == "normal":
                dist = cls("normal", float(parts[1]), float(parts[2]))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"{name}: {text!r} is not N, uniform:A:B or normal:MU:SIGMA "
                             "(integers for N, A and B)") from None
        if dist.kind in ("fixed", "uniform") and dist.a < 1:
            raise ValueError(f"{name}: {text!r}: lengths must be at least 1")
        if dist.kind == "uniform" and dist.b < dist.a:
            raise ValueError(f"{name}: {text!r}: uniform:A:B needs A <= B")
        if dist.kind == "normal" and dist.b < 0:
            raise ValueError(f"{name}: {text!r}: SIGMA must be >= 0")
        return dist

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return int(rng.integers(int(self.a), int(self.b), endpoint=True))
        return max(1, int(round(rng.normal(self.a, self.b))))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        a, b = (int(self.a), int(self.b)) if self.kind == "uniform" else (self.a, self.b)
        return f"{self.kind}:{a:g}:{b:g}"


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: exactly one of `token_ids`, `text` and `messages` is set.
    `ideal_cached_tokens`: prompt tokens one worker with enough cache would reuse (workloads
    with shared prefixes know it); `on_done(output_token_ids)` runs after a successful request
    (a conversation appends the reply to its history)."""
    max_tokens: int
    token_ids: tuple[int, ...] | None = None
    text: str | None = None
    messages: tuple[dict, ...] | None = None
    ideal_cached_tokens: int | None = None
    on_done: Callable[[list[int]], None] | None = None

    @property
    def num_prompt_tokens(self) -> int | None:
        """Known only for token-id prompts; the router reports the others' in its usage."""
        return None if self.token_ids is None else len(self.token_ids)


@dataclass(frozen=True, slots=True)
class FilePrompt:
    """One line of a prompts file: a text prompt or chat messages, and an optional max_tokens."""
    text: str | None = None
    messages: tuple[dict, ...] | None = None
    max_tokens: int | None = None


def synthetic_workload(input_len: LengthDist, output_len: LengthDist, *, vocab_size: int,
                       eos_token_ids: Sequence[int], max_model_len: int,
                       seed: int) -> Iterator[RequestSpec]:
    """Random token-id prompts: ids uniform over [0, vocab_size) minus the EOS ids. Each draw is
    clipped so prompt + output fits max_model_len (output first, to max_model_len - 1)."""
    excluded = set(int(t) for t in eos_token_ids)
    allowed = np.array([t for t in range(vocab_size) if t not in excluded], dtype=np.int64)
    if len(allowed) == 0 or max_model_len < 2:
        raise ValueError(f"the model (vocab_size {vocab_size}, max_model_len {max_model_len}) "
                         "leaves no room for a synthetic prompt")
    rng = np.random.default_rng(seed)
    while True:
        num_input, num_output = input_len.sample(rng), output_len.sample(rng)
        num_output = min(num_output, max_model_len - 1)
        num_input = min(num_input, max_model_len - num_output)
        ids = allowed[rng.integers(0, len(allowed), size=num_input)]
        yield RequestSpec(max_tokens=num_output, token_ids=tuple(int(t) for t in ids))


def file_workload(prompts: Sequence[FilePrompt], output_len: LengthDist, *,
                  seed: int) -> Iterator[RequestSpec]:
    """The file's prompts in order, cycling; a line's own max_tokens wins over `output_len`."""
    if not prompts:
        raise ValueError("the prompts file has no prompts")
    rng = np.random.default_rng(seed)
    for prompt in itertools.cycle(prompts):
        drawn = output_len.sample(rng)  # drawn even when unused, so draws line up by index
        yield RequestSpec(max_tokens=prompt.max_tokens or drawn, text=prompt.text,
                          messages=prompt.messages)


def read_prompts_file(path: str | Path) -> list[FilePrompt]:
    """Reads JSONL: each non-blank line {"prompt": "..."} or {"messages": [{"role", "content"},
    ...]}, with an optional positive integer "max_tokens". Errors name the file and line."""
    prompts = []
    with open(path, encoding="utf-8") as file:
        for line_number, line in enumerate(file, start=1):
            if line.strip():
                try:
                    prompts.append(_parse_line(line))
                except ValueError as exc:
                    raise ValueError(f"{path}, line {line_number}: {exc}") from None
    if not prompts:
        raise ValueError(f"{path}: no prompts (expected one JSON object per line)")
    return prompts


def _parse_line(line: str) -> FilePrompt:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
        raise ValueError('expected an object with exactly one of "prompt" and "messages"')
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise ValueError(f'"max_tokens" must be a positive integer, not {max_tokens!r}')
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise ValueError('"prompt" must be a string')
        return FilePrompt(text=obj["prompt"], max_tokens=max_tokens)
    messages = obj["messages"]
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                       and isinstance(m.get("content"), str) for m in messages)):
        raise ValueError('"messages" must be a non-empty list of {"role": str, "content": str}')
    return FilePrompt(messages=tuple({"role": m["role"], "content": m["content"]}
                                     for m in messages), max_tokens=max_tokens)

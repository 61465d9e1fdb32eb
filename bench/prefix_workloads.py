"""Workloads whose prompts share prefixes, to measure prefix caching and cache-aware routing.

* multi-turn chat (`--workload chat`): C conversations of T turns, each with its own system
  prompt of S tokens (tenants with their own context), or all with the same one
  (`--shared-system-prompt`: one application's users); every turn sends the conversation's
  history (system prompt, earlier user messages and the model's real replies) plus a new user
  message. A conversation sends its next turn only after its previous one finished (and, with
  a think time, after a pause), so C conversations make concurrency C at most.
* shared prefix (`--workload shared-prefix`): G groups, each with its own prefix of P tokens;
  every request is a random group's prefix plus a random suffix.

Prompts are token ids drawn like synthetic_workload's (uniform, EOS ids excluded) from one
seeded generator. Each request carries its ideal cached tokens: what one worker with enough
cache would reuse, counted in full blocks of IDEAL_BLOCK_SIZE tokens (the workers' default
--block-size), at most (prompt - 1) // block_size blocks, as a worker looks up.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence

import numpy as np

from tandem.bench.loadgen import LoadGenerator
from tandem.bench.workload import LengthDist, RequestSpec

__all__ = ["ConversationLoad", "IDEAL_BLOCK_SIZE", "ideal_cached_tokens",
           "shared_prefix_workload"]
IDEAL_BLOCK_SIZE = 16


def ideal_cached_tokens(num_reusable: int, num_prompt_tokens: int,
                        block_size: int = IDEAL_BLOCK_SIZE) -> int:
    """Tokens a worker serves from cache when the prompt's first `num_reusable` tokens' KV was
    computed there before: full blocks only, leaving at least one token to compute."""
    num_blocks = min(num_reusable // block_size, (num_prompt_tokens - 1) // block_size)
    return max(0, num_blocks) * block_size


class _TokenSource:
    """Random prompt token ids, EOS ids excluded."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], seed: int) -> None:
        excluded = set(int(t) for t in eos_token_ids)
        self.allowed = np.array([t for t in range(vocab_size) if t not in excluded],
                                dtype=np.int64)
        if len(self.allowed) == 0:
            raise ValueError(f"vocab_size {vocab_size} leaves no token for a prompt")
        self.rng = np.random.default_rng(seed)

    def tokens(self, num_tokens: int, rng: np.random.Generator | None = None) -> list[int]:
        rng = self.rng if rng is None else rng
        return [int(t) for t in self.allowed[rng.integers(0, len(self.allowed),
                                                          size=num_tokens)]]


def shared_prefix_workload(num_groups: int, prefix_len: int, suffix_len: LengthDist,
                           output_len: LengthDist, *, vocab_size: int,
                           eos_token_ids: Sequence[int], max_model_len: int,
                           seed: int) -> Iterator[RequestSpec]:
    """Endless requests: a random group's prefix plus a random suffix."""
    if num_groups < 1 or prefix_len < 1:
        raise ValueError("shared-prefix: --groups and --prefix-len must be >= 1")
    source = _TokenSource(vocab_size, eos_token_ids, seed)
    prefixes = [source.tokens(prefix_len) for _ in range(num_groups)]
    seen: set[int] = set()
    while True:
        group = int(source.rng.integers(0, num_groups))
        num_output = min(output_len.sample(source.rng), max_model_len - prefix_len - 1)
        num_suffix = min(suffix_len.sample(source.rng), max_model_len - prefix_len - num_output)
        if num_output < 1 or num_suffix < 1:
            raise ValueError(f"shared-prefix: a {prefix_len}-token prefix leaves no room "
                             f"within max_model_len {max_model_len}")
        prompt = prefixes[group] + source.tokens(num_suffix)
        ideal = ideal_cached_tokens(prefix_len, len(prompt)) if group in seen else 0
        seen.add(group)
        yield RequestSpec(max_tokens=num_output, token_ids=tuple(prompt),
                          ideal_cached_tokens=ideal)


class _Conversation:
    def __init__(self, system_prompt: list[int], num_turns: int,
                 rng: np.random.Generator) -> None:
        self.rng = rng  # its own: its turns are the same whatever the timing of the others
        self.history = list(system_prompt)
        self.num_turns_left = num_turns
        self.num_reusable = 0  # tokens whose KV the previous turn computed (0 before it)


class ConversationLoad(LoadGenerator):
    """Runs the multi-turn chat workload: one task per conversation, turns in order.

    config.conversations conversations of config.turns turns; system prompts of
    config.system_prompt_len tokens; each user message's length from config.input_len, each
    reply's from config.output_len. Stops early at config.duration_s (no new turn starts).
    """

    def __init__(self, client, config, model_info: dict) -> None:
        super().__init__(client, config, iter(()))
        self.source = _TokenSource(model_info["vocab_size"], model_info["eos_token_ids"],
                                   config.seed)
        self.max_model_len = model_info["max_model_len"]
        shared = self.source.tokens(config.system_prompt_len) \
            if config.shared_system_prompt else None
        # A shared system prompt is reusable once some turn has been computed with it.
        self.shared_prompt_len = 0
        self.conversations = [
            _Conversation(shared or self.source.tokens(config.system_prompt_len), config.turns,
                          np.random.default_rng([config.seed, index]))
            for index in range(config.conversations)]
        self.progress.total = config.conversations * config.turns

    async def run(self):
        try:
            await asyncio.gather(*(self._converse(c) for c in self.conversations))
        finally:
            self._draw_progress(force=True)
            self.progress.close()
        return sorted(self.records, key=lambda record: record.index)

    def _can_issue(self) -> bool:
        duration_s, started = self.config.duration_s, self._measured_start_s
        return duration_s is None or started is None or \
            time.perf_counter() - started < duration_s

    async def _converse(self, conversation: _Conversation) -> None:
        config = self.config
        while conversation.num_turns_left > 0 and self._can_issue():
            if conversation.num_reusable and config.think_time_s > 0:
                await asyncio.sleep(conversation.rng.exponential(config.think_time_s))
            conversation.num_turns_left -= 1
            user = self.source.tokens(config.input_dist.sample(conversation.rng),
                                      conversation.rng)
            num_output = config.output_dist.sample(conversation.rng)
            prompt = conversation.history + user
            if len(prompt) + num_output > self.max_model_len:
                return  # the conversation outgrew the model: it ends here
            replied = []

            def on_done(output_token_ids: list[int], prompt=prompt, replied=replied) -> None:
                conversation.history = prompt + list(output_token_ids)
                # The last sampled token is never run through the model: no KV for it.
                conversation.num_reusable = len(conversation.history) - 1
                if config.shared_system_prompt:
                    self.shared_prompt_len = config.system_prompt_len
                replied.append(True)

            num_reusable = max(conversation.num_reusable, self.shared_prompt_len)
            spec = RequestSpec(max_tokens=num_output, token_ids=tuple(prompt),
                               ideal_cached_tokens=ideal_cached_tokens(num_reusable,
                                                                       len(prompt)),
                               on_done=on_done)
            await self._send(*self._take_spec(spec))
            if not replied:
                return  # a failed turn leaves no reply to continue from

    def _take_spec(self, spec: RequestSpec) -> tuple[int, RequestSpec]:
        index, self._next_index = self._next_index, self._next_index + 1
        if index == self.config.warmup:
            self._measured_start_s = time.perf_counter()
        return index, spec

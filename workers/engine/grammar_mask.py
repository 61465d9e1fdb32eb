"""A constrained request's grammar state, and the token masks it puts on the sampler's logits.

Each constrained sequence owns a `RequestGrammar`: the future of its compiled grammar
(grammar_cache.py) and, from its first sampled step, its own matcher. The matcher is built
from the tokens the sequence already generated, wherever they came from (this engine, a
prefill worker's first token, a worker the request migrated from), so a request continued
elsewhere is constrained exactly as if one engine had run it.

Per step, `GrammarMasker.apply_` fills one bitmask row per constrained sequence (llguidance,
in parallel over its threads) and sets every disallowed logit to -inf with one tensor op on
the logits' device. Steps with no constrained sequence do no mask work at all.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem.common.logging import get_logger

if TYPE_CHECKING:
    from tandem.workers.engine.sequence import Sequence

logger = get_logger(__name__)
BITS_PER_WORD = 32


class RequestGrammar:
    """One request's grammar: `accept` every token it generates, in order."""

    __slots__ = ("compiled", "matcher", "num_accepted")

    def __init__(self, compiled: Future) -> None:
        self.compiled = compiled  # Future[LLMatcher], pristine and shared: never advanced
        self.matcher = None  # this request's own copy, made by `start`
        self.num_accepted = 0  # completion tokens the matcher has consumed

    @property
    def is_ready(self) -> bool:
        return self.compiled.done()

    def failure(self) -> str | None:
        """Why the grammar did not compile (None: it did, or is still compiling)."""
        if not self.compiled.done():
            return None
        exc = self.compiled.exception()
        return None if exc is None else str(exc)

    def start(self, seq: Sequence) -> None:
        """Build the matcher (once compiled) and consume the tokens seq generated so far."""
        if self.matcher is None:
            self.matcher = self.compiled.result().deep_copy()
        pending = seq.token_ids[seq.num_prompt_tokens + self.num_accepted:]
        if pending:
            self._consume(pending)

    def accept(self, token_id: int) -> bool:
        """Advance past a generated token; True when the grammar is finished (the output is
        complete, or the token broke it: the request must end)."""
        if self.matcher is None:  # no constrained step ran yet (a prefill chunk); nothing to do
            return False
        self._consume([token_id])
        return self.matcher.is_stopped() or self.matcher.is_error()

    def _consume(self, token_ids: list[int]) -> None:
        if not self.matcher.consume_tokens(token_ids):
            logger.warning("generated tokens do not fit the request's grammar: %s",
                           self.matcher.get_error())
        self.num_accepted += len(token_ids)


class GrammarMasker:
    """Masks the logits of constrained rows. One per sampler; not thread-safe."""

    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self.eos_token_ids = eos_token_ids
        self._executor = None  # llguidance.LLExecutor, made on the first constrained step
        self._shifts: dict[torch.device, torch.Tensor] = {}

    def apply_(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """logits: [B, V] fp32, modified in place; row i is seqs[i]'s, constrained when its
        `grammar` is set."""
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return
        from llguidance import LLExecutor
        from llguidance.numpy import fill_next_token_bitmask_par

        if self._executor is None:
            self._executor = LLExecutor()
        vocab_size = logits.shape[1]
        num_words = -(-vocab_size // BITS_PER_WORD)
        bitmask = np.zeros((len(rows), num_words), dtype=np.int32)  # [R, W]
        matchers = []
        for slot, row in enumerate(rows):
            grammar = seqs[row].grammar
            grammar.start(seqs[row])
            matchers.append((grammar.matcher, slot))
        fill_next_token_bitmask_par(self._executor, matchers, bitmask)
        self._allow_eos_in_dead_rows(bitmask, vocab_size)
        allowed = self._unpack(torch.from_numpy(bitmask), logits.device, vocab_size)  # [R, V]
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logits[index] = logits[index].masked_fill_(~allowed, -torch.inf)

    def _allow_eos_in_dead_rows(self, bitmask: np.ndarray, vocab_size: int) -> None:
        """A matcher in error allows nothing; let it end the request instead of sampling from
        an all -inf row."""
        dead = ~bitmask.any(axis=1)
        words = bitmask.view(np.uint32)
        for token in self.eos_token_ids:
            if token < vocab_size:
                words[dead, token // BITS_PER_WORD] |= np.uint32(1 << (token % BITS_PER_WORD))

    def _unpack(self, bitmask: torch.Tensor, device: torch.device,
                vocab_size: int) -> torch.Tensor:
        """[R, W] int32 words (bit b of word w: token 32w + b) -> [R, V] bool on device."""
        shifts = self._shifts.get(device)
        if shifts is None:
            shifts = self._shifts[device] = torch.arange(BITS_PER_WORD, dtype=torch.int32,
                                                         device=device)
        words = bitmask.to(device, non_blocking=True)
        bits = (words[:, :, None] >> shifts) & 1  # [R, W, 32]
        return bits.view(words.shape[0], -1)[:, :vocab_size].bool()

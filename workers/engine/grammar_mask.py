"""A constrained request's grammar state, and the token masks it puts on the sampler's logits.

Each constrained sequence owns a `RequestGrammar`: the future of its compiled grammar
(grammar_cache.py) and, from its first sampled step, its own matcher, copied from one of the
grammar's replicas. The matcher is built from the tokens the sequence already generated,
wherever they came from (this engine, a prefill worker's first token, a worker the request
migrated from), so a request continued elsewhere is constrained exactly as if one engine had
run it.

Per step, `GrammarMasker.apply_` fills one bitmask row per constrained sequence (llguidance,
in parallel over its threads, rows grouped by the replica whose lexer they share) and sets
every disallowed logit to -inf on the logits' device.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import weakref

import numpy as np
import torch

from tandem.common.logging import get_logger
from tandem.workers.engine.grammar_cache import default_fill_threads

if TYPE_CHECKING:
    from tandem.workers.engine.sequence import Sequence

logger = get_logger(__name__)
BITS_PER_WORD = 32
# A request bound while its grammar had fewer replicas moves to a new, lighter one while it
# has accepted at most this many tokens (each is replayed into the new matcher).
MAX_REBIND_TOKENS = 32


class RequestGrammar:
    """One request's grammar: `accept` every token it generates, in order."""

    __slots__ = ("compiled", "matcher", "num_accepted", "use", "num_replicas_seen",
                 "__weakref__")

    def __init__(self, compiled: Future) -> None:
        self.compiled = compiled  # Future[CompiledGrammar], shared by the grammar's requests
        self.matcher = None  # this request's own matcher, made by `start`
        self.num_accepted = 0  # completion tokens the matcher has consumed
        # This request's claim on the compiled grammar (counted from the compile's end, so
        # the grammar's replicas compile while the request prefills).
        self.use = None
        self.num_replicas_seen = 0  # the grammar's replicas when the matcher was (re)bound
        owner = weakref.ref(self)
        compiled.add_done_callback(lambda done: _register(owner, done))

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
        """Build the matcher (once compiled) and consume the tokens seq generated so far.
        A young matcher moves to a replica compiled since it was bound, if that one is
        lighter: a burst of requests that bound before the replicas existed spreads out."""
        compiled = self.compiled.result()
        if self.matcher is None:
            self.num_replicas_seen = compiled.num_replicas
            self.matcher = compiled.bind(compiled.register(self))
        elif compiled.num_replicas != self.num_replicas_seen \
                and self.num_accepted <= MAX_REBIND_TOKENS and not self.matcher.is_error():
            self.num_replicas_seen = compiled.num_replicas
            moved = compiled.rebind(self.use)
            if moved is not None:
                first = seq.num_prompt_tokens
                moved.consume_tokens(seq.token_ids[first:first + self.num_accepted])
                self.matcher = moved
        pending = seq.token_ids[seq.num_prompt_tokens + self.num_accepted:seq.num_known_tokens]
        if pending:
            self._consume(pending)

    @property
    def fill_group(self) -> tuple[int, int]:
        """Rows with equal groups share a lexer (and its lock): the fill keeps them together."""
        return id(self.compiled), self.use.replica

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


def _register(owner: weakref.ref, compiled: Future) -> None:
    grammar = owner()
    if grammar is not None and not compiled.cancelled() and compiled.exception() is None:
        compiled.result().register(grammar)


class GrammarMasker:
    """Masks the logits of constrained rows. One per sampler; not thread-safe.

    A step's mask work, in order (`apply_` runs all three; the host bench times each):
      fill      one bitmask row per constrained sequence, computed by llguidance's threads
                (without the GIL; the rows handed over grouped by replica, so a thread takes
                a run of rows sharing one lexer rather than waiting on another thread's lock)
                into a host buffer kept across steps: [B, W] int32 words,
                bit b of word w set when token 32w + b is allowed. Pinned when the logits live
                on a GPU, so the copy below is asynchronous.
      to_device one copy of the [B, W] words into a buffer on the logits' device (on CPU the
                host words themselves).
      mask_     every disallowed logit set to -inf: on a GPU one AND against the 32 bit values,
                one compare and one masked fill over [B, W, 32]; on CPU numpy unpacks the
                inverted words (the disallowed tokens) and torch fills them.
    Steps with no constrained sequence do no mask work at all.
    """

    def __init__(self, eos_token_ids: tuple[int, ...], num_threads: int | None = None) -> None:
        self.eos_token_ids = eos_token_ids
        self.num_threads = default_fill_threads() if num_threads is None else num_threads
        self._executor = None  # llguidance.LLExecutor, made on the first constrained step
        self._host_words: torch.Tensor | None = None  # [max B, W] int32, reused every step
        self._host_device: torch.device | None = None  # the device _host_words was made for
        self._device_words: torch.Tensor | None = None  # [max B, W] int32 on a GPU
        # Recorded after each copy out of the pinned host words; the next fill waits on it
        # before writing them (the copy is asynchronous).
        self._copied: torch.cuda.Event | None = None
        self._bit_values: dict[torch.device, torch.Tensor] = {}  # [32] int32: 1 << b

    def apply_(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """logits: [B, V] fp32, modified in place; row i is seqs[i]'s, constrained when its
        `grammar` is set."""
        words = self.fill(seqs, logits.shape[1], logits.device)
        if words is not None:
            self.mask_(logits, self.to_device(words, logits.device))

    def fill(self, seqs: list[Sequence], vocab_size: int,
             device: torch.device) -> torch.Tensor | None:
        """The step's bitmask, [B, W] int32 on the host (a view of the reused buffer, valid
        until the next fill); every bit set in unconstrained rows. None when no row is
        constrained."""
        # A sequence that ended while its row was queued keeps no mask: its token is dropped.
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None
                and not seq.is_finished]
        if not rows:
            return None
        from llguidance import LLExecutor
        from llguidance.numpy import fill_next_token_bitmask_par

        if self._executor is None:
            self._executor = LLExecutor(self.num_threads)
        words = self._reserve_host_words(len(seqs), -(-vocab_size // BITS_PER_WORD), device)
        array = words.numpy()
        if len(rows) < len(seqs):  # rows a grammar left behind in the buffer allow everything
            array[sorted(set(range(len(seqs))) - set(rows))] = -1
        for row in rows:
            seqs[row].grammar.start(seqs[row])
        rows.sort(key=lambda row: seqs[row].grammar.fill_group)
        fill_next_token_bitmask_par(self._executor,
                                    [(seqs[row].grammar.matcher, row) for row in rows], array)
        self._allow_eos_in_dead_rows(array, vocab_size)
        return words

    def to_device(self, words: torch.Tensor, device: torch.device) -> torch.Tensor:
        """words (from `fill`) on device: one asynchronous copy from pinned memory into a
        buffer kept there. On CPU, words itself."""
        if device.type != "cuda":
            return words
        if self._device_words is None or self._device_words.device != device \
                or self._device_words.shape[0] < words.shape[0] \
                or self._device_words.shape[1] != words.shape[1]:
            self._device_words = torch.empty(self._host_words.shape, dtype=torch.int32,
                                             device=device)
        on_device = self._device_words[:words.shape[0]]
        on_device.copy_(words, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()
        return on_device

    def mask_(self, logits: torch.Tensor, words: torch.Tensor) -> None:
        """Sets logits [B, V] to -inf where words [B, W] (on the logits' device) clear the
        token's bit."""
        if words.device.type == "cpu":
            mask_with_numpy_(logits, words)
            return
        bits = self._bit_values.get(words.device)
        if bits is None:
            bits = self._bit_values[words.device] = bit_values(words.device)
        mask_with_tensor_ops_(logits, words, bits)

    def _reserve_host_words(self, num_rows: int, num_words: int,
                            device: torch.device) -> torch.Tensor:
        """[num_rows, num_words] of the reused host buffer, pinned for a GPU's logits, once
        the previous copy out of it has finished."""
        pinned = device.type == "cuda"
        buffer = self._host_words
        if buffer is None or buffer.shape[0] < num_rows or buffer.shape[1] != num_words \
                or self._host_device != device:
            if self._copied is not None:
                self._copied.synchronize()  # the old buffer may still be read by a copy
            capacity = max(num_rows, 0 if buffer is None else buffer.shape[0])
            buffer = torch.empty((capacity, num_words), dtype=torch.int32, pin_memory=pinned)
            self._host_words, self._host_device = buffer, device
        elif self._copied is not None:
            self._copied.synchronize()
        return buffer[:num_rows]

    def _allow_eos_in_dead_rows(self, array: np.ndarray, vocab_size: int) -> None:
        """A matcher in error allows nothing; let it end the request instead of sampling from
        an all -inf row. (Unconstrained rows allow everything, so only grammars' rows can be
        dead.)"""
        dead = np.flatnonzero(~array.any(axis=1))
        if not len(dead):
            return
        words = array.view(np.uint32)
        for token in self.eos_token_ids:
            if token < vocab_size:
                words[dead, token // BITS_PER_WORD] |= np.uint32(1 << (token % BITS_PER_WORD))


def mask_with_numpy_(logits: torch.Tensor, words: torch.Tensor) -> None:
    """CPU: numpy unpacks the inverted words into [B, V] disallowed flags; one masked fill."""
    disallowed = np.unpackbits((~words.numpy()).view(np.uint8), axis=1, count=logits.shape[1],
                               bitorder="little")  # [B, V] uint8
    logits.masked_fill_(torch.from_numpy(disallowed.view(np.bool_)), -torch.inf)


def mask_with_tensor_ops_(logits: torch.Tensor, words: torch.Tensor,
                          bits: torch.Tensor) -> None:
    """Any device, three tensor ops: words [B, W] AND bits [32] -> [B, W, 32], compared with
    zero (disallowed), then one masked fill of the first V of each row's 32W flags."""
    num_rows, vocab_size = logits.shape
    disallowed = (words[:, :, None] & bits) == 0  # [B, W, 32] bool
    logits.masked_fill_(disallowed.view(num_rows, -1)[:, :vocab_size], -torch.inf)


def bit_values(device: torch.device) -> torch.Tensor:
    """[32] int32, entry b = 1 << b (entry 31 is the sign bit)."""
    values = [1 << b for b in range(BITS_PER_WORD)]
    values[-1] -= 1 << BITS_PER_WORD  # as a two's-complement int32
    return torch.tensor(values, dtype=torch.int32, device=device)

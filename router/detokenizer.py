"""Incremental detokenization: token ids in, text deltas out, never half a character.

The prefix/read-offset technique. `ids` holds a few prompt tokens of context, then the
generated ones; text is emitted only from tokens at or after `prefix`:

    ids:  [ ... | prefix ......... | read ............ ]
                 `-- prefix text --'                    P = decode(ids[prefix:read])
                 `---------- window text -------------'  T = decode(ids[prefix:])

`T[len(P):]` is the new text. It is held back while T ends in U+FFFD (the last token stopped
inside a multi-byte character; the next token completes it); once emitted, prefix moves to
read and read to the end. Decoding from a token or more before the new ones keeps
context-dependent text right: SentencePiece decoders strip the leading space of the first
token they see, so "▁world" alone is "world" but after "▁Hello" it is " world". Each add()
decodes at most two windows of a few tokens; the text is never decoded from its start.

Invariant (tests/unit/router/test_detokenizer.py), with D(x) = tokenizer.decode(x,
skip_special_tokens=s, clean_up_tokenization_spaces=False):

    "".join(deltas) + flush() == D(prompt + generated)[len(D(prompt)):]

for any generated ids, given a prompt that decodes to whole characters (any encoded text).
For byte-level BPE (Qwen, Llama-3) that is D(generated); SentencePiece's D(generated) differs
only in dropping the first token's leading space, which a continuation must keep. Two limits:
byte-fallback decoders (Llama-2) turn a whole run of <0xXX> tokens into U+FFFDs when the run
is not valid UTF-8, and streamed characters already sent stay as they were; the
clean_up_tokenization_spaces rewrite (" ," -> ",") looks ahead, so it is never applied.
"""
from __future__ import annotations

import functools

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the first generated one (their text is never emitted).
NUM_CONTEXT_TOKENS = 4
MAX_CONTEXT_TOKENS = NUM_CONTEXT_TOKENS + 4
# Ids before the window are dropped once this many have piled up (amortised O(1) per token).
MAX_DEAD_IDS = 256


@functools.lru_cache(maxsize=16)
def _special_ids(tokenizer) -> frozenset[int]:
    """The ids that decode(skip_special_tokens=True) drops: added tokens marked special.
    Cached per tokenizer, so tokens are added to it before its first request, never after."""
    return frozenset(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)


class IncrementalDetokenizer:
    """Streams the text of one request's generated tokens; one instance per request."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError("IncrementalDetokenizer needs a fast (tokenizers-backed) tokenizer")
        # tokenizer.decode for a fast tokenizer is this call plus the optional cleanup, which
        # must stay off (module docstring); calling the backend directly is 3x cheaper.
        self._backend_decode = functools.partial(
            backend.decode, skip_special_tokens=skip_special_tokens
        )
        # Skipped ids never enter the window, so the context is real text and a window of
        # only special tokens (which would decode to "" and lose a leading space) cannot occur.
        self._skipped_ids = _special_ids(tokenizer) if skip_special_tokens else frozenset()

        self._ids, context_text = self._context(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._num_prefix_chars = len(context_text)

    def add(self, token_ids: list[int]) -> str:
        """Appends generated ids; returns the text they complete ("" inside a character)."""
        ids = self._ids
        num_ids_before = len(ids)
        skipped_ids = self._skipped_ids
        for token_id in token_ids:
            if token_id not in skipped_ids:
                ids.append(token_id)
        if len(ids) == num_ids_before:
            return ""
        text = self._backend_decode(ids[self._prefix_offset :])
        if len(text) <= self._num_prefix_chars or text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """At the end of the stream: the held-back text, U+FFFD for bytes never completed."""
        text = self._backend_decode(self._ids[self._prefix_offset :])
        if len(text) <= self._num_prefix_chars:
            return ""
        return self._emit(text)

    def _context(self, prompt_token_ids: list[int]) -> tuple[list[int], str]:
        """The last NUM_CONTEXT_TOKENS kept prompt ids and their text, taking up to
        MAX_CONTEXT_TOKENS where fewer end in U+FFFD: a byte-fallback decoder turns a run of
        <0xXX> pieces into U+FFFDs unless it starts on a character boundary."""
        tail: list[int] = []
        for token_id in reversed(prompt_token_ids):
            if token_id not in self._skipped_ids:
                tail.append(token_id)
                if len(tail) == MAX_CONTEXT_TOKENS:
                    break
        tail.reverse()
        for start in range(max(0, len(tail) - NUM_CONTEXT_TOKENS), -1, -1):
            text = self._backend_decode(tail[start:])
            if not text.endswith(REPLACEMENT_CHAR):
                return tail[start:], text
        # The prompt stops inside a character: decode the output on its own instead.
        return [], ""

    def _emit(self, text: str) -> str:
        delta = text[self._num_prefix_chars :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset >= MAX_DEAD_IDS:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        prefix_ids = self._ids[self._prefix_offset : self._read_offset]
        self._num_prefix_chars = len(self._backend_decode(prefix_ids))
        return delta

"""Turns a request's generated tokens into the chunks a client receives.

Detokenizes incrementally, holds back possible stop-string prefixes, and cuts the text at the
first stop string. Per token: one small window decode and a suffix check, nothing more.
"""
from __future__ import annotations

from tandem.router.detokenizer import IncrementalDetokenizer
from tandem.router.stop_strings import StopStringMatcher
from tandem.v1 import generate_pb2


class OutputAssembler:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str]) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stops = StopStringMatcher(list(stop))
        self.token_ids: list[int] = []
        self.matched_stop: str | None = None

    def add(self, token_ids: list[int], logprobs=()) -> generate_pb2.Chunk | None:
        """A chunk for these tokens (None if there is nothing to send). After a stop string
        matched, the caller must end the stream: further tokens are ignored."""
        if self.matched_stop is not None:
            return None
        self.token_ids.extend(token_ids)
        text, self.matched_stop = self._stops.feed(self._detokenizer.add(token_ids))
        if not text and not token_ids:
            return None
        return generate_pb2.Chunk(text=text, token_ids=token_ids, logprobs=list(logprobs))

    def finish(self) -> generate_pb2.Chunk | None:
        """Text held back until the end (an incomplete character, a stop-string prefix)."""
        if self.matched_stop is not None:
            return None
        text, self.matched_stop = self._stops.feed(self._detokenizer.flush())
        text += self._stops.flush() if self.matched_stop is None else ""
        return generate_pb2.Chunk(text=text) if text else None

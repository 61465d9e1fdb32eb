"""Stop strings over streamed text: emit what can no longer become part of a stop string.

A stop string can arrive split over several deltas, so the matcher holds back the longest
suffix of the pending text that is a prefix of some stop string, and nothing else:

    stop = ["</s>"], deltas "Hi <" "/" "s> tail"  ->  emits "Hi ", "", "" and matches "</s>"

The match is the first occurrence to complete, which is where a model streaming the text
would stop; of several that complete at the same character, the longest (earliest-starting)
one. So the result does not depend on how the text was split into deltas: stop = ["abc", "b"]
on "abc" gives "a" and matches "b". Nothing after a match is ever returned.
"""
from __future__ import annotations


class StopStringMatcher:
    """One per request. feed() each text delta in order; flush() once at the end."""

    def __init__(self, stop: list[str]):
        for index, stop_string in enumerate(stop):
            if not stop_string:
                raise ValueError(f"stop: stop strings must be non-empty (stop[{index}] is empty)")
        self._stops = tuple(dict.fromkeys(stop))
        # Proper prefixes of the stop strings: the suffixes worth holding back.
        self._stop_prefixes = frozenset(s[:k] for s in self._stops for k in range(1, len(s)))
        self._first_chars = frozenset(s[0] for s in self._stops)
        self._max_held_chars = max((len(s) - 1 for s in self._stops), default=0)
        self._pending = ""
        self._is_stopped = False

    def feed(self, text_delta: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string matched by this delta or None)."""
        if not self._stops:
            return text_delta, None
        if self._is_stopped:
            return "", None
        text = self._pending + text_delta
        match = self._first_match(text)
        if match is not None:
            start, stop_string = match
            self._pending = ""
            self._is_stopped = True
            return text[:start], stop_string
        num_held = self._num_held_chars(text)
        self._pending = text[len(text) - num_held :]
        return text[: len(text) - num_held], None

    def flush(self) -> str:
        """The held-back text at the end of the stream ("" after a match)."""
        held, self._pending = self._pending, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        # Every earlier occurrence would have matched an earlier delta, and one that ends in
        # this delta starts inside the held-back suffix, so searching `text` is enough.
        best_end, best = len(text) + 1, None
        for stop_string in self._stops:
            start = text.find(stop_string)
            if start < 0:
                continue
            end = start + len(stop_string)
            if end < best_end or (end == best_end and start < best[0]):
                best_end, best = end, (start, stop_string)
        return best

    def _num_held_chars(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for start in range(max(0, len(text) - self._max_held_chars), len(text)):
            if text[start] in self._first_chars and text[start:] in self._stop_prefixes:
                return len(text) - start
        return 0

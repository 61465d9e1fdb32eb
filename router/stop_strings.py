"""Stop strings over streamed text: emit what can no longer become part of a stop string.

A stop string can arrive split over several deltas, so the matcher holds back the longest
suffix of the pending text that is a prefix of some stop string, and nothing else:

    stop = ["</s>"], deltas "Hi <" "/" "s> tail"  ->  emits "Hi ", "", "" and matches "</s>"

The match is the first occurrence to complete, which is where a model streaming the text
would stop; of several that complete at the same character, the longest (earliest-starting)
one. So the result does not depend on how the text was split into deltas: stop = ["abc", "b"]
on "abc" gives "a" and matches "b". Nothing after a match is ever returned.

Each stop string runs a Knuth-Morris-Pratt automaton whose state is the length of its longest
prefix that ends the text fed so far; the held-back suffix is the longest such state. Time is
linear in the text fed (times the number of stop strings) and memory linear in the stop
strings' length, however long they are.
"""
from __future__ import annotations


class StopStringMatcher:
    """One per request. feed() each text delta in order; flush() once at the end."""

    def __init__(self, stop: list[str]):
        for index, stop_string in enumerate(stop):
            if not stop_string:
                raise ValueError(f"stop: stop strings must be non-empty (stop[{index}] is empty)")
        self._automata = [_PrefixAutomaton(s) for s in dict.fromkeys(stop)]
        self._pending = ""
        self._is_stopped = False

    def feed(self, text_delta: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string matched by this delta or None)."""
        if not self._automata:
            return text_delta, None
        if self._is_stopped:
            return "", None
        text = self._pending + text_delta
        for offset, char in enumerate(text_delta):
            matched = None
            for automaton in self._automata:
                if automaton.advance(char) and (matched is None
                                                or len(automaton.stop) > len(matched)):
                    matched = automaton.stop
            if matched is not None:
                # The match starts inside the held-back text or this delta: the held-back
                # suffix was at least as long as this automaton's state before the delta.
                end = len(self._pending) + offset + 1
                self._pending = ""
                self._is_stopped = True
                return text[: end - len(matched)], matched
        num_held = max(automaton.state for automaton in self._automata)
        self._pending = text[len(text) - num_held :]
        return text[: len(text) - num_held], None

    def flush(self) -> str:
        """The held-back text at the end of the stream ("" after a match)."""
        held, self._pending = self._pending, ""
        return held


class _PrefixAutomaton:
    """KMP over one stop string. `state`: the length of the longest proper prefix of `stop`
    that ends the text fed so far."""

    __slots__ = ("stop", "state", "_fallback")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.state = 0
        # _fallback[k]: the longest proper prefix of stop[:k + 1] that is also its suffix.
        fallback = [0] * len(stop)
        length = 0
        for i in range(1, len(stop)):
            while length and stop[i] != stop[length]:
                length = fallback[length - 1]
            if stop[i] == stop[length]:
                length += 1
            fallback[i] = length
        self._fallback = fallback

    def advance(self, char: str) -> bool:
        """Feeds one character; True when the whole stop string now ends the text."""
        stop, state = self.stop, self.state
        while state and stop[state] != char:
            state = self._fallback[state - 1]
        if stop[state] == char:
            state += 1
        if state == len(stop):
            self.state = self._fallback[state - 1]
            return True
        self.state = state
        return False

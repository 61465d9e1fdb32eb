"""Stop strings over streamed text: emit what can no longer become part of a stop string.

A stop string can arrive split over several deltas, so the matcher holds back the longest
suffix of the pending text that is a prefix of some stop string, and nothing else:

    stop = ["</s>"], deltas "Hi <" "/" "s> tail"  ->  emits "Hi ", "", "" and matches "</s>"

The match is the first occurrence to complete, which is where a model streaming the text
would stop; of several that complete at the same character, the longest (earliest-starting)
one. So the result does not depend on how the text was split into deltas: stop = ["abc", "b"]
on "abc" gives "a" and matches "b". Nothing after a match is ever returned.

Each stop string runs a Knuth-Morris-Pratt automaton whose state is the length of its longest
proper prefix that ends the text fed so far; the held-back suffix is the longest such state.
Only automata in a state above 0 (few, usually none) and those whose stop string starts with
the character fed do any work. Time is linear in the text fed (times the number of stop
strings) and memory linear in the stop strings' length, however long they are.
"""
from __future__ import annotations


class StopStringMatcher:
    """One per request. feed() each text delta in order; flush() once at the end."""

    def __init__(self, stop: list[str]):
        for index, stop_string in enumerate(stop):
            if not stop_string:
                raise ValueError(f"stop: stop strings must be non-empty (stop[{index}] is empty)")
        self._stops = tuple(dict.fromkeys(stop))
        self._fallbacks = [_fallback_table(s) for s in self._stops]
        self._by_first_char: dict[str, list[int]] = {}
        for index, stop_string in enumerate(self._stops):
            self._by_first_char.setdefault(stop_string[0], []).append(index)
        self._states: dict[int, int] = {}  # stop index -> its automaton's state, if above 0
        self._pending = ""
        self._is_stopped = False

    def feed(self, text_delta: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string matched by this delta or None)."""
        if not self._stops:
            return text_delta, None
        if self._is_stopped:
            return "", None
        text = self._pending + text_delta
        for offset, char in enumerate(text_delta):
            if not self._states and char not in self._by_first_char:
                continue
            matched = self._advance(char)
            if matched is not None:
                # The match starts inside the held-back text or this delta: the held-back
                # suffix was at least as long as this automaton's state before the delta.
                end = len(self._pending) + offset + 1
                self._pending = ""
                self._is_stopped = True
                return text[: end - len(matched)], matched
        num_held = max(self._states.values(), default=0)
        self._pending = text[len(text) - num_held :]
        return text[: len(text) - num_held], None

    def flush(self) -> str:
        """The held-back text at the end of the stream ("" after a match)."""
        held, self._pending = self._pending, ""
        return held

    def _advance(self, char: str) -> str | None:
        """Feeds one character to every automaton; the longest stop string it completes."""
        advanced: dict[int, int] = {}
        for index, state in self._states.items():
            stop_string, fallback = self._stops[index], self._fallbacks[index]
            while state and stop_string[state] != char:
                state = fallback[state - 1]
            if stop_string[state] == char:
                advanced[index] = state + 1
        for index in self._by_first_char.get(char, ()):
            advanced.setdefault(index, 1)  # from state 0 (or back to 1)
        self._states = advanced
        completed = [self._stops[i] for i, state in advanced.items()
                     if state == len(self._stops[i])]
        return max(completed, key=len) if completed else None


def _fallback_table(stop_string: str) -> list[int]:
    """KMP failure function: [k] is the longest proper prefix of stop_string[:k + 1] that is
    also its suffix."""
    fallback = [0] * len(stop_string)
    length = 0
    for i in range(1, len(stop_string)):
        while length and stop_string[i] != stop_string[length]:
            length = fallback[length - 1]
        if stop_string[i] == stop_string[length]:
            length += 1
        fallback[i] = length
    return fallback

"""StopStringMatcher: what is emitted never holds any part of a matched stop string.

Reference semantics (`truncate_at_first_stop`): the first stop string to complete, reading the
text left to right; of those completing at the same character the longest. The emitted text is
the text before it, the same however the text is split into deltas.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from tandem.router.stop_strings import StopStringMatcher


def truncate_at_first_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    for end in range(1, len(text) + 1):
        completed = [s for s in stops if text.endswith(s, 0, end)]
        if completed:
            stop_string = max(completed, key=len)
            return text[: end - len(stop_string)], stop_string
    return text, None


def run(stops: list[str], deltas: list[str]) -> tuple[list[str], str | None, str]:
    """Feeds deltas until a match; returns (emitted pieces, matched stop, flush())."""
    matcher = StopStringMatcher(stops)
    emitted, matched = [], None
    for delta in deltas:
        text, matched = matcher.feed(delta)
        emitted.append(text)
        if matched is not None:
            break
    return emitted, matched, matcher.flush()


def test_stop_split_across_deltas():
    emitted, matched, tail = run(["</s>"], ["Hi <", "/", "s> tail"])
    assert emitted == ["Hi ", "", ""] and matched == "</s>" and tail == ""


def test_overlapping_candidates_first_to_complete_wins():
    assert run(["abc", "ab"], ["xa", "bc"]) == (["x", ""], "ab", "")
    assert run(["abc", "b"], ["abc"]) == (["a"], "b", "")  # "b" completes before "abc"
    assert run(["b", "ab"], ["xab"]) == (["x"], "ab", "")  # same end: the longer one
    assert run(["abc"], ["xab", "d"]) == (["x", "abd"], None, "")  # held, then released


def test_stop_beginning_inside_held_back_text():
    # "aa" is held as a possible start of "aab"; the match then starts at its second "a".
    assert run(["aab"], ["xaa", "ab", "never"]) == (["x", "a"], "aab", "")
    assert run(["abcd"], ["zab", "c", "dz"]) == (["z", "", ""], "abcd", "")


def test_multiple_stops():
    stops = ["\n\nUser:", "###", "<|end|>"]
    emitted, matched, tail = run(stops, ["Sure.", "\n\n", "Use", "r: more"])
    assert "".join(emitted) == "Sure." and matched == "\n\nUser:" and tail == ""
    emitted, matched, _ = run(stops, ["Sure.\n\n", "Us", "#", "##"])
    assert "".join(emitted) == "Sure.\n\nUs" and matched == "###"


def test_match_at_the_very_start():
    assert run(["STOP"], ["STOP and more"]) == ([""], "STOP", "")
    assert run(["STOP"], ["ST", "OP"]) == (["", ""], "STOP", "")


def test_no_match_flush_returns_the_rest():
    matcher = StopStringMatcher(["xyz", "\n\n"])
    assert matcher.feed("abc x") == ("abc ", None)
    assert matcher.feed("y") == ("", None)
    assert matcher.feed("\n") == ("xy", None)
    assert matcher.flush() == "\n"
    assert matcher.flush() == ""


def test_nothing_after_a_match():
    matcher = StopStringMatcher(["end"])
    assert matcher.feed("the end is near") == ("the ", "end")
    assert matcher.feed("more end") == ("", None)
    assert matcher.flush() == ""


def test_empty_stop_list_passes_through():
    matcher = StopStringMatcher([])
    delta = "anything at all"
    text, matched = matcher.feed(delta)
    assert text is delta and matched is None
    assert matcher.flush() == ""


@pytest.mark.parametrize("stops", [[""], ["ok", ""]])
def test_empty_stop_string_is_rejected(stops):
    with pytest.raises(ValueError, match="stop"):
        StopStringMatcher(stops)


def longest_held_suffix(text: str, stops: list[str]) -> int:
    held = [k for k in range(1, len(text) + 1) for s in stops if s[:k] == text[-k:] != s]
    return max(held, default=0)


alphabet_text = st.text(st.sampled_from("abc"), max_size=5)


@settings(max_examples=400, deadline=None)
@given(
    stops=st.lists(st.text(st.sampled_from("abc"), min_size=1, max_size=4), max_size=3),
    deltas=st.lists(alphabet_text, max_size=12),
)
def test_emitted_text_is_the_text_before_the_first_stop(stops, deltas):
    expected_text, expected_stop = truncate_at_first_stop("".join(deltas), stops)
    matcher = StopStringMatcher(stops)
    fed, emitted, matched = "", "", None
    for delta in deltas:
        text, matched = matcher.feed(delta)
        fed += delta
        emitted += text
        # Never emits what a later delta could turn into part of a stop string.
        assert expected_text.startswith(emitted)
        if matched is not None:
            break
        # Holds back exactly the longest suffix that is a proper prefix of a stop string.
        assert len(fed) - len(emitted) == longest_held_suffix(fed, stops)
    if matched is None:
        emitted += matcher.flush()
    assert (emitted, matched) == (expected_text, expected_stop)


def test_long_stop_strings_take_linear_memory():
    """A stop string of n characters costs O(n) memory, not the O(n^2) of all its prefixes."""
    import tracemalloc

    num_chars = 20_000
    stop = "a" * (num_chars - 1) + "b"
    tracemalloc.start()
    try:
        matcher = StopStringMatcher([stop, "ab" * (num_chars // 2)])
        emitted = [matcher.feed("a" * 100)[0] for _ in range(2 * num_chars // 100)]
        text, matched = matcher.feed("b tail")
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Everything but the last n - 1 "a"s (a possible start of the stop string) goes out.
    assert "".join(emitted) == "a" * (num_chars + 1) and (text, matched) == ("", stop)
    assert peak_bytes < 20 * num_chars * 8  # a few lists and strings of n entries

"""IncrementalDetokenizer against real tokenizers (conftest.py says which).

The invariant, with
D(x) = tokenizer.decode(x, skip_special_tokens=s, clean_up_tokenization_spaces=False):

    "".join(add() deltas) + flush() == D(prompt + generated)[len(D(prompt)):]

for any generated ids fed in any group sizes, with prompts that encode text. On byte-level BPE
this is also D(generated); on SentencePiece the first generated token keeps its leading space,
which D(generated) strips. A delta from add() never ends in U+FFFD, and a U+FFFD in any delta
stands where the full decode has one. For the byte-fallback tokenizer, random ids avoid runs of
<0xXX> pieces that are not valid UTF-8 (module docstring of detokenizer.py: a documented limit).
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import pytest

from tandem.router.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

BYTE_LEVEL = ["qwen-3", "deepseek-r1-distill-llama-8b"]
SENTENCEPIECE = ["jiutian-139moe-chat", "jiutian-byte-fallback"]
TEXTS = [
    "héllo 世界 🤖🚀 🫠🦜𝔘",
    "我们的世界充满了奇迹和挑战。人工智能正在改变生活。",
    "👨‍👩‍👧‍👦 family, 👍🏽 ok 🇯🇵",
    "Ελληνικά и русский текст, 한국어 텍스트",
    "  two  spaces\n\nand a tab\t. def f(x):\n    return x ** 2  # ✓",
]
PROMPTS = ["", "User: say something.\nAssistant:", "前文：", "ends in emoji 🤖", "snowmen ☃☄"]
SETTINGS = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def decode(tokenizer, ids, skip_special_tokens=True):
    return tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def stream(tokenizer, prompt_ids, generated_ids, group_sizes=(1,), skip_special_tokens=True):
    """Feeds generated_ids in groups (sizes cycle); returns (add() deltas, flush())."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    deltas, start, index = [], 0, 0
    while start < len(generated_ids):
        size = group_sizes[index % len(group_sizes)]
        deltas.append(detokenizer.add(generated_ids[start : start + size]))
        start, index = start + size, index + 1
    return deltas, detokenizer.flush()


def check_invariant(tokenizer, prompt_ids, generated_ids, group_sizes=(1,), skip=True):
    deltas, tail = stream(tokenizer, prompt_ids, generated_ids, group_sizes, skip)
    prompt_text = decode(tokenizer, prompt_ids, skip)
    full_text = decode(tokenizer, prompt_ids + generated_ids, skip)
    assert full_text.startswith(prompt_text)
    expected = full_text[len(prompt_text) :]
    assert not any(delta.endswith(REPLACEMENT_CHAR) for delta in deltas), deltas
    offset = 0
    for delta in [*deltas, tail]:
        for i, char in enumerate(delta):
            if char == REPLACEMENT_CHAR:
                assert expected[offset + i : offset + i + 1] == REPLACEMENT_CHAR, (deltas, tail)
        offset += len(delta)
    assert "".join(deltas) + tail == expected
    return deltas, tail


@pytest.mark.parametrize("name", BYTE_LEVEL + SENTENCEPIECE)
@pytest.mark.parametrize("text", TEXTS)
def test_encoded_text_streams_back_whole(load_tokenizer, name, text):
    tokenizer = load_tokenizer(name)
    generated_ids = encode(tokenizer, text)
    for prompt in PROMPTS:
        prompt_ids = encode(tokenizer, prompt)
        for group_sizes in [(1,), (2, 3), (len(generated_ids),)]:
            deltas, tail = check_invariant(tokenizer, prompt_ids, generated_ids, group_sizes)
            assert REPLACEMENT_CHAR not in "".join(deltas) + tail
            if name in BYTE_LEVEL:  # byte-level BPE: also the standalone decode, here the text
                assert "".join(deltas) + tail == decode(tokenizer, generated_ids) == text


@pytest.mark.parametrize("name", BYTE_LEVEL + ["jiutian-byte-fallback"])
def test_partial_characters_are_held_until_complete(load_tokenizer, name):
    tokenizer = load_tokenizer(name)
    generated_ids = encode(tokenizer, " 🤖🚀")
    deltas, tail = stream(tokenizer, encode(tokenizer, "Robot:"), generated_ids)
    assert "" in deltas  # some tokens end inside an emoji's 4 bytes
    assert "".join(deltas) == " 🤖🚀" and tail == ""
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_sentencepiece_continuation_keeps_its_leading_space(load_tokenizer, name):
    tokenizer = load_tokenizer(name)
    generated_ids = encode(tokenizer, "Hello world")  # "▁Hello ▁world"-style pieces
    assert decode(tokenizer, generated_ids) == "Hello world"  # standalone: space stripped
    deltas, tail = stream(tokenizer, encode(tokenizer, "Say:"), generated_ids)
    assert "".join(deltas) + tail == " Hello world"
    deltas, tail = stream(tokenizer, [], generated_ids)  # no prompt: nothing to continue
    assert "".join(deltas) + tail == "Hello world"


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_prompt_ending_in_special_tokens_still_gives_context(load_tokenizer, name):
    tokenizer = load_tokenizer(name)
    prompt_ids = encode(tokenizer, "Q?") + [tokenizer.eos_token_id, tokenizer.bos_token_id] * 4
    generated_ids = encode(tokenizer, "Hi there")
    deltas, tail = check_invariant(tokenizer, prompt_ids, generated_ids)
    assert "".join(deltas) + tail == " Hi there"


@pytest.mark.parametrize("name", BYTE_LEVEL + SENTENCEPIECE)
def test_special_tokens_skipped_or_kept(load_tokenizer, name):
    tokenizer = load_tokenizer(name)
    special_id = tokenizer.eos_token_id
    special_text = tokenizer.convert_ids_to_tokens(special_id)
    generated_ids = encode(tokenizer, " Hi") + [special_id] + encode(tokenizer, " there")
    prompt_ids = encode(tokenizer, "Greet:")
    deltas, tail = check_invariant(tokenizer, prompt_ids, generated_ids, skip=True)
    assert special_text not in "".join(deltas) + tail
    assert ("".join(deltas) + tail).endswith("Hi there")
    deltas, tail = check_invariant(tokenizer, prompt_ids, generated_ids, skip=False)
    assert special_text in "".join(deltas) + tail


def _partial_utf8_ids(tokenizer):
    """Ids of tokens that stop inside a character (decoded alone they show U+FFFD)."""
    ids = encode(tokenizer, "🤖🚀👍🏽👨‍👩‍👧 世界奇迹挑战한국어 ἀρχή ∑∫ 𝔘𝔫𝔦")
    return sorted({i for i in ids if REPLACEMENT_CHAR in decode(tokenizer, [i])})


@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_random_ids_byte_level(load_tokenizer, name):
    tokenizer = load_tokenizer(name)
    partial_ids = _partial_utf8_ids(tokenizer)
    special_ids = sorted(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    assert len(partial_ids) >= 5 and special_ids
    token_id = st.one_of(
        st.integers(0, len(tokenizer) - 1),
        st.sampled_from(partial_ids),
        st.sampled_from(special_ids),
    )

    @SETTINGS
    @given(
        prompt=st.sampled_from(PROMPTS),
        generated_ids=st.lists(token_id, max_size=40),
        group_sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4),
        skip=st.booleans(),
    )
    def run(prompt, generated_ids, group_sizes, skip):
        prompt_ids = encode(tokenizer, prompt)
        check_invariant(tokenizer, prompt_ids, generated_ids, tuple(group_sizes), skip)
        deltas, tail = stream(tokenizer, prompt_ids, generated_ids, tuple(group_sizes), skip)
        assert "".join(deltas) + tail == decode(tokenizer, generated_ids, skip)

    run()


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_random_ids_sentencepiece(load_tokenizer, name):
    tokenizer = load_tokenizer(name)
    # Random ids, but no <0xXX> pieces: a run of those that is not valid UTF-8 decodes to
    # U+FFFDs as a whole (the documented limit); valid runs come from encoded text below.
    plain_ids = [
        i for i in range(len(tokenizer)) if not tokenizer.convert_ids_to_tokens(i).startswith("<0x")
    ]
    text = st.text(st.sampled_from("ab ▁é世界🤖🚀\n"), max_size=8)
    segment = st.one_of(
        st.lists(st.sampled_from(plain_ids), min_size=1, max_size=3),
        text.map(lambda t: encode(tokenizer, t)),
        st.just([tokenizer.eos_token_id]),
    )

    @SETTINGS
    @given(
        prompt=st.sampled_from(PROMPTS),
        segments=st.lists(segment, max_size=12),
        group_sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4),
        skip=st.booleans(),
    )
    def run(prompt, segments, group_sizes, skip):
        generated_ids = [i for ids in segments for i in ids]
        prompt_ids = encode(tokenizer, prompt)
        check_invariant(tokenizer, prompt_ids, generated_ids, tuple(group_sizes), skip)

    run()


def test_byte_fallback_invalid_run_keeps_streamed_characters(load_tokenizer):
    """The documented limit: an invalid <0xXX> run decodes to U+FFFDs as a whole in D(...)."""
    tokenizer = load_tokenizer("jiutian-byte-fallback")
    byte_ids = tokenizer.convert_tokens_to_ids(["<0xE4>", "<0xB8>", "<0x96>", "<0xE7>"])
    generated_ids = encode(tokenizer, "hello") + byte_ids + encode(tokenizer, "hello")
    deltas, tail = stream(tokenizer, [], generated_ids)
    assert decode(tokenizer, generated_ids) == "hello\ufffd\ufffd\ufffd\ufffd hello"
    # "世" was complete and sent before <0xE7> spoilt the run; the rest follows D(...).
    assert "世" in deltas
    assert "".join(deltas) + tail == "hello世\ufffd\ufffd\ufffd hello"


class RecordingTokenizer:
    """Forwards to a real fast tokenizer and records the length of every decoded window."""

    def __init__(self, tokenizer):
        self.added_tokens_decoder = tokenizer.added_tokens_decoder
        self.backend_tokenizer = self
        self._backend = tokenizer.backend_tokenizer
        self.window_sizes: list[int] = []

    def decode(self, ids, skip_special_tokens):
        self.window_sizes.append(len(ids))
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("name", BYTE_LEVEL + SENTENCEPIECE)
def test_per_token_work_is_a_small_window(load_tokenizer, name):
    tokenizer = load_tokenizer(name)
    generated_ids = encode(tokenizer, "".join(TEXTS) * 12)
    assert len(generated_ids) > 600  # past the point where dead ids are dropped (256)
    recorder = RecordingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(recorder, encode(tokenizer, PROMPTS[1]))
    text = "".join(detokenizer.add([i]) for i in generated_ids) + detokenizer.flush()
    prompt_ids = encode(tokenizer, PROMPTS[1])
    full_text = decode(tokenizer, prompt_ids + generated_ids)
    assert text == full_text[len(decode(tokenizer, prompt_ids)) :]
    assert max(recorder.window_sizes) <= 8
    assert len(recorder.window_sizes) <= 2 * len(generated_ids) + 2
    num_decodes = len(recorder.window_sizes)
    assert detokenizer.add([tokenizer.eos_token_id] * 3) == ""  # skipped: nothing to decode
    assert len(recorder.window_sizes) == num_decodes


def test_prompt_ending_inside_a_character_decodes_output_alone(load_tokenizer):
    tokenizer = load_tokenizer("qwen-3")
    emoji_ids = encode(tokenizer, "🫠")
    assert len(emoji_ids) > 1
    generated_ids = emoji_ids[-1:] + encode(tokenizer, " ok")
    deltas, tail = stream(tokenizer, encode(tokenizer, "a") + emoji_ids[:-1], generated_ids)
    assert "".join(deltas) + tail == decode(tokenizer, generated_ids)


def test_flush_twice_and_slow_tokenizers(load_tokenizer):
    tokenizer = load_tokenizer("qwen-3")
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert detokenizer.add(encode(tokenizer, "🫠")[:1]) == ""
    assert detokenizer.flush() == REPLACEMENT_CHAR
    assert detokenizer.flush() == ""
    with pytest.raises(TypeError, match="fast"):
        IncrementalDetokenizer(object(), [])

"""Tool calls: the format a chat template asks for, parsing answers (whole and streamed), and the
grammar that forces a call, checked with llguidance against Qwen3's real tokenizer."""
from __future__ import annotations

import json
import random

import pytest

from tandem.router.tokenization import template_inputs
from tandem.router.tool_calls import (HERMES, LLAMA3_JSON, ParsedCall, ToolCallStream, ToolSpec,
                                      call_grammar, detect_format, parse_tool_calls,
                                      single_token_markers)
from tandem.v1 import generate_pb2

WEATHER = ToolSpec("get_weather", "Weather in a city", {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                   "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False})
CLOCK = ToolSpec("get_time", "", {"type": "object", "properties": {}})
HERMES_ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                 '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
                 '"arguments": {}}\n</tool_call>')


def test_formats_come_from_the_chat_template(load_tokenizer):
    assert detect_format(load_tokenizer("qwen-3").chat_template) == HERMES
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert detect_format('{% if tools %}{"name": x, "parameters": y}{% endif %}') == LLAMA3_JSON
    assert detect_format(None) is None


def test_hermes_answer_splits_into_content_and_calls():
    content, calls = parse_tool_calls(HERMES, HERMES_ANSWER)
    assert content == "Let me check."
    assert calls == [ParsedCall("get_weather", '{"city": "Paris"}'),
                     ParsedCall("get_time", "{}")]


def test_a_block_that_is_no_call_stays_content():
    text = 'a <tool_call>\n{not json}\n</tool_call> b <tool_call>\n{"name": "nope", ' \
           '"arguments": {}}\n</tool_call> c <tool_ca'
    assert parse_tool_calls(HERMES, text, names={"get_time"}) == (text, [])


@pytest.mark.parametrize("seed", range(20))
def test_streamed_pieces_give_what_the_whole_answer_gives(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(HERMES_ANSWER)), rng.randrange(1, 30)))
    pieces = [HERMES_ANSWER[a:b] for a, b in zip([0, *cuts], [*cuts, len(HERMES_ANSWER)])]
    stream = ToolCallStream(HERMES)
    content, calls = "", []
    for piece in pieces:
        text, found = stream.feed(piece)
        assert "<" not in text  # nothing of a marker leaks into the content
        content, calls = content + text, calls + found
    text, found = stream.finish()
    assert (content + text, calls + found) == parse_tool_calls(HERMES, HERMES_ANSWER)


def test_llama3_json_answers():
    text = '{"name": "get_weather", "parameters": {"city": "Oslo; Norway"}}; ' \
           '{"name": "get_time", "parameters": {}}'
    assert parse_tool_calls(LLAMA3_JSON, text) == ("", [
        ParsedCall("get_weather", '{"city": "Oslo; Norway"}'), ParsedCall("get_time", "{}")])
    assert parse_tool_calls(LLAMA3_JSON, "Hello there") == ("Hello there", [])
    half = '{"name": "get_time", "parameters": {}}; {"name": '
    assert parse_tool_calls(LLAMA3_JSON, half) == (half, [])  # all or nothing


def _matches(grammar: str, tokenizer, text: str) -> bool:
    """Whether llguidance's matcher for `grammar` accepts exactly `text`."""
    import llguidance
    import llguidance.hf

    if not hasattr(tokenizer, "_llguidance"):  # about a second to build: once per tokenizer
        tokenizer._llguidance = llguidance.hf.from_tokenizer(tokenizer)
    matcher = llguidance.LLMatcher(tokenizer._llguidance,
                                   llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


def test_the_forcing_grammar_takes_only_declared_calls_with_valid_arguments(load_tokenizer):
    pytest.importorskip("llguidance")
    tokenizer = load_tokenizer("qwen-3")
    markers = single_token_markers(tokenizer)
    assert markers == {"<tool_call>", "</tool_call>"}
    one = call_grammar(HERMES, [WEATHER, CLOCK], parallel=False, single_tokens=markers)
    many = call_grammar(HERMES, [WEATHER, CLOCK], parallel=True, single_tokens=markers)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert _matches(one, tokenizer, call)
    assert _matches(many, tokenizer, HERMES_ANSWER[len("Let me check.\n"):])
    assert not _matches(one, tokenizer, HERMES_ANSWER[len("Let me check.\n"):])
    for bad in ('<tool_call>\n{"name": "get_wind", "arguments": {}}\n</tool_call>',
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
                '</tool_call>',
                '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
                "Sure! " + call):
        assert not _matches(one, tokenizer, bad), bad
    llama = call_grammar(LLAMA3_JSON, [CLOCK], parallel=False)
    assert _matches(llama, tokenizer, '{"name": "get_time", "parameters": {}}')


def test_template_inputs_render_tools_and_earlier_calls(load_tokenizer):
    tokenizer = load_tokenizer("qwen-3")
    chat = generate_pb2.ChatMessages(tool_choice="auto")
    chat.tools.add(name="get_weather", description="Weather in a city",
                   parameters_json=json.dumps(WEATHER.parameters))
    chat.messages.add(role="user", content="Weather in Paris?")
    assistant = chat.messages.add(role="assistant", content="")
    assistant.tool_calls.add(id="call_1", name="get_weather", arguments_json='{"city": "Paris"}')
    chat.messages.add(role="tool", content="18 C", tool_call_id="call_1")
    messages, tools = template_inputs(chat)
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=True)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n18 C\n</tool_response>" in text
    chat.tool_choice = "none"
    assert template_inputs(chat)[1] is None


def _responses(text: str, piece: int) -> list[generate_pb2.GenerateResponse]:
    responses = [generate_pb2.GenerateResponse(chunk=generate_pb2.Chunk(text=text[i:i + piece]))
                 for i in range(0, len(text), piece)]
    complete = generate_pb2.Complete(finish_reason=generate_pb2.FINISH_REASON_STOP)
    return responses + [generate_pb2.GenerateResponse(complete=complete)]


def test_chat_output_streams_and_returns_tool_calls_in_openai_shapes():
    from tandem.router.openai_api import CompletionOutput, LogprobFormatter, ToolCallParsing

    def output():
        return CompletionOutput("chat", "chatcmpl-x", "m", 1, LogprobFormatter(None), 1,
                                tools=ToolCallParsing(HERMES, {"get_weather", "get_time"}))

    streamed = output()
    chunks = [streamed.add(0, r) for r in _responses(HERMES_ANSWER, 7)]
    deltas = [c["choices"][0]["delta"] for c in chunks if c is not None]
    content = "".join(d.get("content", "") for d in deltas)
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert content == "Let me check."
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls] == [(0, "get_weather", {"city": "Paris"}), (1, "get_time", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = output()
    for response in _responses(HERMES_ANSWER, 1000):
        whole.add(0, response)
    [choice] = whole.whole()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == [
        "get_weather", "get_time"]
    plain = output()
    for response in _responses("No tools needed.", 4):
        plain.add(0, response)
    [choice] = plain.whole()["choices"]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]

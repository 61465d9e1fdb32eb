"""The OpenAI request bodies -> GenerateRequests: every supported field reaches the proto."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tandem.router.openai_api import _param_of
from tandem.router.openai_schema import ChatCompletionRequest, CompletionRequest, OpenAIError
from tandem.v1 import generate_pb2


def test_every_chat_field_reaches_the_generate_request():
    body = ChatCompletionRequest(
        model="m", messages=[{"role": "system", "content": "be brief"},
                             {"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "text", "text": "b"}]}],
        max_completion_tokens=9, temperature=0.5, top_p=0.9, n=2, stop="END", seed=7,
        presence_penalty=0.1, frequency_penalty=0.2, logprobs=True, top_logprobs=3,
        user="u", top_k=5, min_p=0.05, repetition_penalty=1.1, min_tokens=2, ignore_eos=True,
        stop_token_ids=[4])
    body.check()
    first, second = body.to_generate_requests("chatcmpl-x")
    assert [(m.role, m.content) for m in first.chat.messages] == [("system", "be brief"),
                                                                 ("user", "ab")]
    assert first.model == "m" and first.request_id == "chatcmpl-x-0"
    sampling = first.sampling
    assert sampling.temperature == pytest.approx(0.5) and sampling.top_p == pytest.approx(0.9)
    assert sampling.top_k == 5 and sampling.min_p == pytest.approx(0.05)
    assert sampling.presence_penalty == pytest.approx(0.1)
    assert sampling.frequency_penalty == pytest.approx(0.2)
    assert sampling.repetition_penalty == pytest.approx(1.1)
    assert (sampling.seed, second.sampling.seed) == (7, 8)
    stop = first.stop
    assert stop.max_tokens == 9 and stop.min_tokens == 2 and list(stop.stop) == ["END"]
    assert list(stop.stop_token_ids) == [4] and stop.ignore_eos
    assert first.logprobs == 3


def test_tools_tool_choice_and_earlier_calls_reach_the_chat():
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "3 C"}],
        tools=[{"type": "function", "function": {
            "name": "get_weather", "description": "d",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "get_time"}}],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False)
    body.check()
    [message] = body.to_generate_requests("chatcmpl-x")
    chat = message.chat
    assert [(t.name, t.description) for t in chat.tools] == [("get_weather", "d"),
                                                             ("get_time", "")]
    assert '"city"' in chat.tools[0].parameters_json and chat.tools[1].parameters_json == ""
    assert chat.tool_choice == "get_time" and chat.parallel_tool_calls is False
    call = chat.messages[1].tool_calls[0]
    assert (call.id, call.name, call.arguments_json) == ("call_1", "get_weather",
                                                         '{"city": "Oslo"}')
    assert chat.messages[2].tool_call_id == "call_1" and chat.messages[2].content == "3 C"
    with pytest.raises(OpenAIError) as info:
        ChatCompletionRequest(messages=[{"role": "user", "content": None}]).check()
    assert info.value.param == "messages[0].content"


def test_absent_fields_stay_absent_so_the_router_defaults_apply():
    [message] = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]) \
        .to_generate_requests("c")
    assert not message.sampling.ListFields() and not message.stop.HasField("max_tokens")
    assert not message.HasField("logprobs") and message.model == ""


def test_completion_prompts_give_n_requests_each():
    body = CompletionRequest(prompt=["one", "two"], n=2, logprobs=1)
    messages = body.to_generate_requests("cmpl-x")
    assert [m.text for m in messages] == ["one", "one", "two", "two"]
    assert [m.request_id[-1] for m in messages] == ["0", "1", "2", "3"]
    assert all(m.logprobs == 1 for m in messages)
    [ids] = CompletionRequest(prompt=[1, 2, 3]).to_generate_requests("c")
    assert list(ids.token_ids.ids) == [1, 2, 3]
    assert len(CompletionRequest(prompt=[[1], [2]]).to_generate_requests("c")) == 2


@pytest.mark.parametrize("fields, param", [
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
])
def test_openai_only_checks_name_the_field(fields, param):
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)
    with pytest.raises(OpenAIError) as info:
        body.check()
    assert info.value.param == param


def test_unknown_fields_are_refused_even_inside_messages():
    with pytest.raises(ValidationError, match="functions"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], functions=[])
    with pytest.raises(ValidationError, match="function_call"):
        ChatCompletionRequest(messages=[{"role": "assistant", "content": "x",
                                         "function_call": {}}])
    with pytest.raises(ValidationError, match="image_url"):
        ChatCompletionRequest(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}])


@pytest.mark.parametrize("message, param", [
    ("sampling.top_p=1.5 must be in (0, 1]", "top_p"),
    ("stop.max_tokens=0 must be >= 1", "max_tokens"),
    ("stop.stop[0] is empty", "stop"),
    ("token_ids.ids[2]=100000 is outside the vocabulary [0, 384)", "prompt"),
    ("chat.messages[0].role='x' is not one of system", "messages"),
    ("chat.tools[1].name='f' is declared twice", "tools"),
    ("chat.tool_choice='g' is not auto, none, required", "tool_choice"),
    ("model='x' is not served here", "model"),
    ("structured_output.json_schema is not valid JSON: ...", "response_format"),
    ("structured_output: one of json_schema, ...", "response_format"),
    ("router is shutting down", None),
])
def test_servicer_messages_map_to_openai_params(message, param):
    assert _param_of(message) == param


def test_response_format_becomes_structured_output():
    chat = [{"role": "user", "content": "x"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    [message] = ChatCompletionRequest(messages=chat, response_format={
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": schema, "strict": True}},
    ).to_generate_requests("c")
    assert json.loads(message.structured_output.json_schema) == schema
    [message] = CompletionRequest(prompt="x", response_format={"type": "json_object"}) \
        .to_generate_requests("c")
    assert message.structured_output.WhichOneof("format") == "json_object"
    [message] = ChatCompletionRequest(messages=chat, response_format={"type": "text"}) \
        .to_generate_requests("c")
    assert not message.HasField("structured_output")
    [message] = ChatCompletionRequest(messages=chat, response_format={
        "type": "json_schema", "json_schema": {"name": "any"}}).to_generate_requests("c")
    assert json.loads(message.structured_output.json_schema) == {}
    with pytest.raises(OpenAIError) as info:
        ChatCompletionRequest(messages=chat, response_format={"type": "json_schema"}) \
            .to_generate_requests("c")
    assert info.value.param == "response_format"
    with pytest.raises(ValidationError, match="response_format"):
        ChatCompletionRequest(messages=chat, response_format={"type": "yaml"})

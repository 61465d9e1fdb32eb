"""check_request: size limits hold before tokenization, each error names its limit."""
from __future__ import annotations

import grpc
import pytest

from tandem.router.validation import (MAX_CHARS_PER_TOKEN, MAX_STOP_STRING_CHARS, ModelLimits,
                                      RequestError, check_request)
from tandem.v1 import generate_pb2

LIMITS = ModelLimits(name="tiny", vocab_size=384, max_model_len=512, has_chat_template=True)
MAX_CHARS = LIMITS.max_model_len * MAX_CHARS_PER_TOKEN


def rejection(**fields) -> RequestError:
    with pytest.raises(RequestError) as info:
        check_request(generate_pb2.GenerateRequest(**fields), LIMITS)
    return info.value


def test_text_longer_than_the_model_can_hold_is_refused_before_tokenizing():
    check_request(generate_pb2.GenerateRequest(text="x" * MAX_CHARS), LIMITS)
    error = rejection(text="x" * (MAX_CHARS + 1))
    assert error.code == grpc.StatusCode.OUT_OF_RANGE
    assert f"text has {MAX_CHARS + 1} characters" in error.message
    assert f"at most {MAX_CHARS}" in error.message


def test_chat_size_counts_every_message():
    half = "y" * (MAX_CHARS // 2 + 1)
    chat = generate_pb2.ChatMessages(messages=[
        generate_pb2.ChatMessage(role="user", content=half),
        generate_pb2.ChatMessage(role="assistant", content=half)])
    error = rejection(chat=chat)
    assert error.code == grpc.StatusCode.OUT_OF_RANGE and "chat.messages" in error.message
    many = generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="user")] * 600)
    error = rejection(chat=many)
    assert error.code == grpc.StatusCode.OUT_OF_RANGE and "600 messages" in error.message


def test_too_many_token_ids_is_refused_before_checking_each():
    error = rejection(token_ids=generate_pb2.TokenIds(ids=[10**6] * LIMITS.max_model_len))
    assert error.code == grpc.StatusCode.OUT_OF_RANGE
    assert "token_ids.ids has 512 tokens; max_model_len=512" in error.message


def test_stop_string_length_is_bounded():
    stop = generate_pb2.StopConditions(stop=["ok", "z" * MAX_STOP_STRING_CHARS])
    check_request(generate_pb2.GenerateRequest(text="hi", stop=stop), LIMITS)
    stop = generate_pb2.StopConditions(stop=["ok", "z" * 30_000])
    error = rejection(text="hi", stop=stop)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.message == (f"stop.stop[1] has 30000 characters; at most "
                             f"{MAX_STOP_STRING_CHARS} per stop string")


TOOL_LIMITS = ModelLimits(name="tiny", vocab_size=384, max_model_len=512,
                          has_chat_template=True, tool_call_format="hermes")


def tool_chat(tools=(), choice="", **first) -> generate_pb2.GenerateRequest:
    chat = generate_pb2.ChatMessages(tool_choice=choice)
    for name, parameters in tools:
        chat.tools.add(name=name, parameters_json=parameters)
    chat.messages.add(role=first.pop("role", "user"), content="hi", **first)
    return generate_pb2.GenerateRequest(chat=chat)


@pytest.mark.parametrize("request_, limits, message", [
    (tool_chat([("f", "")]), LIMITS, "chat.tools: model 'tiny' has a chat template that renders "
                                     "no tools"),
    (tool_chat([("bad name", "")]), TOOL_LIMITS, "chat.tools[0].name='bad name' must be"),
    (tool_chat([("f", ""), ("f", "")]), TOOL_LIMITS, "chat.tools[1].name='f' is declared twice"),
    (tool_chat([("f", "{oops")]), TOOL_LIMITS, "chat.tools[0].parameters_json is not valid JSON"),
    (tool_chat([("f", "[]")]), TOOL_LIMITS, "chat.tools[0].parameters_json must be a JSON object"),
    (tool_chat([("f", '{"type": "string"}')]), TOOL_LIMITS,
     "chat.tools[0].parameters_json must be an object schema"),
    (tool_chat([("f", "")], choice="g"), TOOL_LIMITS, "chat.tool_choice='g' is not auto, none"),
    (tool_chat(choice="required"), TOOL_LIMITS, "chat.tool_choice=required needs chat.tools"),
    (tool_chat(tool_call_id="call_1"), TOOL_LIMITS, "chat.messages[0].tool_call_id: only a tool"),
    (tool_chat(tool_calls=[generate_pb2.ToolCall(name="f", arguments_json="{}")]), TOOL_LIMITS,
     "chat.messages[0].tool_calls: only an assistant turn"),
    (tool_chat(role="assistant", tool_calls=[generate_pb2.ToolCall(name="f",
                                                                   arguments_json="1")]),
     TOOL_LIMITS, "chat.messages[0].tool_calls[0].arguments_json must be a JSON object"),
])
def test_bad_tools_are_refused_naming_the_field(request_, limits, message):
    with pytest.raises(RequestError) as info:
        check_request(request_, limits)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.startswith(message), info.value.message


def test_good_tools_pass():
    schema = '{"type": "object", "properties": {"x": {"type": "integer"}}}'
    for choice in ("", "auto", "none", "required", "f"):
        check_request(tool_chat([("f", schema), ("g-2", "")], choice=choice), TOOL_LIMITS)
    check_request(tool_chat(role="tool", tool_call_id="call_1"), TOOL_LIMITS)

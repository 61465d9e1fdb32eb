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

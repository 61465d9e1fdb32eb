"""Tool calling through the OpenAI API with the official client: a tiny random Qwen3 that has
Qwen3's real tokenizer and chat template, behind a real router and worker. tool_choice
"required" and a named tool are enforced by a grammar, so even random weights answer with a
parseable call to a declared function whose arguments validate against its schema; streamed
tool_calls deltas join to the same call; earlier calls and tool results go back through the
template."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from helpers.checkpoints import build_qwen3_with_real_tokenizer
from helpers.processes import free_port, start_stack, stop

pytestmark = pytest.mark.slow

WEATHER = {"type": "object",
           "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                          "unit": {"enum": ["c", "f"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ALARM = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}}]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris this week?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model = build_qwen3_with_real_tokenizer(tmp_path_factory.mktemp("qwen3_real_tokenizer"))
    http_port = free_port()
    stack = start_stack(model, tmp_path_factory.mktemp("tool_logs"), num_prefill=0,
                        num_decode=0, num_both=1, router_args=["--http-port", str(http_port)])
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused",
                        max_retries=0, timeout=120)
    stop(stack.processes)


def check_call(call, names=tuple(SCHEMAS)) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def test_required_always_gives_a_valid_call(client):
    for seed in range(8):
        reply = client.chat.completions.create(
            model="", messages=MESSAGES, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=120)
        [choice] = reply.choices
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        check_call(call)


def test_a_named_tool_is_the_one_called(client):
    reply = client.chat.completions.create(
        model="", messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "set_alarm"}})
    calls = reply.choices[0].message.tool_calls
    assert calls and all(check_call(c, ("set_alarm",)) is not None for c in calls)


def test_streamed_deltas_join_to_the_same_call(client):
    fields = dict(model="", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, temperature=1.0, seed=11, max_tokens=120)
    whole = client.chat.completions.create(**fields).choices[0].message.tool_calls[0]
    joined, finish = {}, None
    for chunk in client.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                entry = joined.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert joined == {0: {"name": whole.function.name, "arguments": whole.function.arguments}}


def test_a_tool_result_goes_back_to_the_model(client):
    first = client.chat.completions.create(
        model="", messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=120).choices[0].message
    call = first.tool_calls[0]
    reply = client.chat.completions.create(
        model="", tools=TOOLS, max_tokens=8, temperature=0, messages=[
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}])
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > client.chat.completions.create(
        model="", messages=MESSAGES, tools=TOOLS, max_tokens=1).usage.prompt_tokens


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, max_tokens=4,
                                       **fields)
    assert info.value.body["param"] == param, info.value.body

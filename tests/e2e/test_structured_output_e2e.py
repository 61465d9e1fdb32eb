"""Structured output through a real router -> prefill -> decode stack: the decode worker
rebuilds each request's grammar from the prefill's first token, so the split gives the tokens
one engine gives; bad specs are INVALID_ARGUMENT naming the problem; the decode worker counts
its constrained requests; the OpenAI API's response_format (official client) gives JSON that
validates, whole or streamed."""
from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest
from helpers.checkpoints import random_prompts
from helpers.client import generate, request, router_counter
from helpers.processes import free_port, start_stack, stop

from tandem import LLM, SamplingParams
from tandem.common.convert import structured_output_to_proto
from tandem.common.structured_output import StructuredOutput
from tandem.v1 import generate_pb2

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "size": {"enum": ["s", "m", "l"]},
        "dims": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                 "maxItems": 3},
        "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                 "required": ["ok"], "additionalProperties": False},
    },
    "required": ["name", "size", "dims", "meta"],
    "additionalProperties": False,
}
SPECS = [StructuredOutput("json_schema", json.dumps(SCHEMA)),
         StructuredOutput("regex", r"[0-9]{2,4}(-[a-f]{1,3})?"),
         StructuredOutput("choice", choices=("alpha", "beta", "gamma delta"))]


@pytest.fixture(scope="module")
def split_stack(checkpoint, tmp_path_factory):
    decode_metrics, http_port = free_port(), free_port()
    stack = start_stack(checkpoint("llama").path, tmp_path_factory.mktemp("structured_logs"),
                        router_args=["--http-port", str(http_port)],
                        role_args={"decode": ["--metrics-port", str(decode_metrics),
                                              "--metrics-host", "127.0.0.1"]})
    stack.decode_metrics = f"127.0.0.1:{decode_metrics}"
    stack.client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1",
                                 api_key="unused", max_retries=0, timeout=60)
    yield stack
    stop(stack.processes)


def constrained(prompt, spec: StructuredOutput, temperature: float, seed: int | None = None):
    message = request(prompt, max_tokens=120, min_tokens=0, temperature=temperature,
                      seed=seed)
    message.structured_output.CopyFrom(structured_output_to_proto(spec))
    return message


def check_shape(spec: StructuredOutput, text: str) -> None:
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(spec.spec))
    elif spec.kind == "regex":
        assert re.fullmatch(spec.spec, text), text
    else:
        assert text in spec.choices


def test_split_gives_one_engines_tokens_and_valid_shapes(split_stack, checkpoint):
    prompts = random_prompts([6, 30], seed=12)
    cases = [(spec, temperature, 5) for spec in SPECS for temperature in (0.0, 1.0)]
    with LLM(checkpoint("llama").path, dtype="float32") as llm:
        expected = {(i, j): llm.generate(prompt, SamplingParams(
            temperature=temperature, seed=seed, max_tokens=120, structured_output=spec))[0]
            for i, prompt in enumerate(prompts)
            for j, (spec, temperature, seed) in enumerate(cases)}
    decoded_kinds = []  # requests the decode worker continued (more than the first token)
    for i, prompt in enumerate(prompts):
        for j, (spec, temperature, seed) in enumerate(cases):
            result = generate(split_stack.router.address,
                              constrained(prompt, spec, temperature, seed))
            assert result.token_ids == expected[i, j].token_ids, (spec.kind, temperature)
            assert result.complete.finish_reason == generate_pb2.FINISH_REASON_STOP
            check_shape(spec, result.text)
            if len(result.token_ids) > 1:
                decoded_kinds.append(spec.kind)
    assert "json_schema" in decoded_kinds
    assert router_counter(split_stack.decode_metrics, "tandem:constrained_requests") \
        == len(decoded_kinds)
    # Every request after the first of each spec found its grammar compiled.
    assert router_counter(split_stack.decode_metrics, "tandem:grammar_cache_hits") \
        == len(decoded_kinds) - len(set(decoded_kinds))


@pytest.mark.parametrize("spec,fragment", [
    (generate_pb2.StructuredOutput(regex="[a-"), "structured_output.regex: "),
    (generate_pb2.StructuredOutput(json_schema="{not json"),
     "structured_output.json_schema is not valid JSON"),
    (generate_pb2.StructuredOutput(json_schema='{"type": "objekt"}'), "objekt"),
    (generate_pb2.StructuredOutput(grammar="start: nowhere"), "nowhere"),
    (generate_pb2.StructuredOutput(choice=generate_pb2.Choice()),
     "structured_output.choice needs at least one string"),
    (generate_pb2.StructuredOutput(), "structured_output: one of json_schema"),
])
def test_a_bad_spec_is_invalid_argument_naming_it(split_stack, spec, fragment):
    message = request([1, 2, 3], max_tokens=8)
    message.structured_output.CopyFrom(spec)
    message.structured_output.SetInParent()  # present even when spec sets no field
    with pytest.raises(grpc.RpcError) as info:
        generate(split_stack.router.address, message)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in info.value.details()


def test_openai_response_format_gives_valid_json(split_stack):
    client = split_stack.client
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "describe a box"}]
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "box", "schema": SCHEMA, "strict": True}}
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=120,
                                           temperature=1.0, seed=4, n=3,
                                           response_format=response_format)
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=120,
                                            temperature=0.0, stream=True,
                                            response_format=response_format)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "stop"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    # Any object: a random model may not close it within max_tokens, but it opens one.
    reply = client.completions.create(model=model, prompt="a box:", max_tokens=40,
                                      temperature=0.0,
                                      extra_body={"response_format": {"type": "json_object"}})
    text = reply.choices[0].text
    assert text.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_openai_bad_schema_is_a_400_naming_response_format(split_stack):
    client = split_stack.client
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "objekt"}}})
    assert info.value.body["param"] == "response_format"
    assert "objekt" in info.value.message

"""Greedy output through router -> prefill -> decode (and through one aggregated worker)
equals the offline LLM and transformers; many concurrent streams; bad requests."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from helpers.checkpoints import random_prompts
from helpers.client import generate, request, worker_load

from tandem import LLM, SamplingParams
from tandem.v1 import generate_pb2, generate_pb2_grpc

TEXT_PROMPTS = ["Paris is the capital of", "The quick brown fox", "héllo wörld 世界",
                "def generate(prompt):"]


@pytest.fixture(scope="module")
def offline(checkpoint):
    return LLM(checkpoint("llama").path, dtype="float32")


@pytest.mark.parametrize("stack_name", ["pd_stack", "both_stack"])
def test_greedy_tokens_equal_offline_and_transformers(request_fixture, stack_name, checkpoint,
                                                     offline):
    stack = request_fixture.getfixturevalue(stack_name)
    ckpt = checkpoint("llama")
    prompts = random_prompts([1, 9, 40, 130], seed=51)
    for prompt in prompts:
        result = generate(stack.router.address, request(prompt, max_tokens=24))
        assert result.token_ids == ckpt.greedy(prompt, 24)
        assert result.complete.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert result.complete.usage.completion_tokens == 24
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    for text, expected in zip(TEXT_PROMPTS, offline.generate(TEXT_PROMPTS, params)):
        result = generate(stack.router.address, request(text, max_tokens=24))
        assert result.token_ids == expected.token_ids
        assert result.text == expected.text


@pytest.fixture
def request_fixture(request):
    return request


def test_32_concurrent_streams_complete_with_exact_text(pd_stack, checkpoint):
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(
        str(checkpoint("llama").path))
    prompts = [f"{TEXT_PROMPTS[i % 4]} {i}" for i in range(32)]

    def run(i):
        return generate(pd_stack.router.address,
                        request(prompts[i], max_tokens=20 + i, temperature=1.0, seed=i))

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, range(32)))
    for i, result in enumerate(results):
        assert result.complete is not None
        assert len(result.token_ids) == result.complete.usage.completion_tokens
        prompt_ids = tokenizer.encode(prompts[i])
        full = tokenizer.decode(prompt_ids + result.token_ids, skip_special_tokens=True)
        assert result.text == full[len(tokenizer.decode(prompt_ids,
                                                        skip_special_tokens=True)):]
    # Every request finished: both workers hold no blocks and nothing is pinned.
    for worker in pd_stack.workers.values():
        load = worker_load(worker.address)
        assert load.kv_usage == 0 and load.num_pinned == 0 and load.num_running == 0


def test_stop_string_is_never_emitted(pd_stack, offline):
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    [expected] = offline.generate([TEXT_PROMPTS[0]], params)
    stop = expected.text[5:8]
    assert stop and stop in expected.text
    message = request(TEXT_PROMPTS[0], max_tokens=24)
    message.stop.stop.append(stop)
    result = generate(pd_stack.router.address, message)
    assert result.text == expected.text[: expected.text.index(stop)]
    assert result.complete.finish_reason == generate_pb2.FINISH_REASON_STOP
    assert result.complete.matched_stop == stop


def _bad(**fields):
    message = request("hello", max_tokens=4)
    for path, value in fields.items():
        target, name = message, path
        if "." in path:
            parent, name = path.split(".")
            target = getattr(message, parent)
        if isinstance(value, list):
            getattr(target, name).extend(value)
        elif name == "clear_prompt":
            message.ClearField("prompt")
        else:
            setattr(target, name, value)
    return message


BAD_REQUESTS = [
    ("empty text", _bad(text=""), grpc.StatusCode.INVALID_ARGUMENT, "text"),
    ("no prompt", _bad(clear_prompt=True), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("too long", request(list(range(10, 300)) * 2, max_tokens=4), grpc.StatusCode.OUT_OF_RANGE,
     "max_model_len"),
    ("max_tokens 0", _bad(**{"stop.max_tokens": 0}), grpc.StatusCode.INVALID_ARGUMENT,
     "stop.max_tokens"),
    ("max_tokens negative", _bad(**{"stop.max_tokens": -3}), grpc.StatusCode.INVALID_ARGUMENT,
     "stop.max_tokens"),
    ("negative temperature", _bad(**{"sampling.temperature": -0.5}),
     grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
    ("top_p zero", _bad(**{"sampling.top_p": 0.0}), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.top_p"),
    ("top_p above one", _bad(**{"sampling.top_p": 1.5}), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.top_p"),
    ("token id >= vocab", request([5, 384], max_tokens=4), grpc.StatusCode.OUT_OF_RANGE,
     "token_ids.ids[1]"),
    ("unknown model", _bad(model="gpt-17"), grpc.StatusCode.NOT_FOUND, "model"),
    ("chat without messages", generate_pb2.GenerateRequest(chat=generate_pb2.ChatMessages()),
     grpc.StatusCode.INVALID_ARGUMENT, "chat.messages"),
    ("chat bad role", generate_pb2.GenerateRequest(chat=generate_pb2.ChatMessages(
        messages=[generate_pb2.ChatMessage(role="robot", content="hi")])),
     grpc.StatusCode.INVALID_ARGUMENT, "chat.messages[0].role"),
    ("empty stop string", _bad(**{"stop.stop": [""]}), grpc.StatusCode.INVALID_ARGUMENT,
     "stop.stop[0]"),
    ("logprobs too many", _bad(logprobs=50), grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
]


@pytest.mark.parametrize("name,message,code,field", BAD_REQUESTS,
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_requests_get_a_status_naming_the_field(pd_stack, name, message, code, field):
    with pytest.raises(grpc.RpcError) as info:
        generate(pd_stack.router.address, message)
    assert info.value.code() == code, info.value.details()
    assert field in info.value.details()
    # The stack keeps serving.
    assert generate(pd_stack.router.address, request([1, 2, 3], max_tokens=2)).complete


def test_chat_and_model_info(pd_stack):
    with grpc.insecure_channel(pd_stack.router.address) as channel:
        info = generate_pb2_grpc.GenerateStub(channel).GetModelInfo(
            generate_pb2.GetModelInfoRequest(), timeout=5)
    assert info.vocab_size == 384 and info.max_model_len == 512 and info.has_chat_template
    message = generate_pb2.GenerateRequest(
        model=info.model, chat=generate_pb2.ChatMessages(
            messages=[generate_pb2.ChatMessage(role="user", content="hi")]),
        stop=generate_pb2.StopConditions(max_tokens=5, min_tokens=5))
    result = generate(pd_stack.router.address, message)
    assert result.complete.usage.prompt_tokens > 3 and len(result.token_ids) == 5

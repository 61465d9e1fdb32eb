"""The router's OpenAI-compatible HTTP API, driven by the official `openai` client against a
real router + prefill + decode stack on the tiny Llama (its tokenizer has a chat template)."""
from __future__ import annotations

import dataclasses
import http.client
import json
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest
from helpers.client import generate, request, worker_load
from helpers.processes import free_port, start, start_stack, stop, wait_serving

from tandem.bench import BenchmarkConfig, run_benchmark
from tandem.bench.http_vs_grpc import Target, format_table, measure, ratios, summarize_runs
from tandem.bench.main import main as bench_main
from tandem.v1 import generate_pb2

GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"min_tokens": 12})
TOKEN = "http-e2e-token"


@pytest.fixture(scope="module")
def http_stack(checkpoint, tmp_path_factory):
    port, decode_metrics_port = free_port(), free_port()
    stack = start_stack(checkpoint("llama").path, tmp_path_factory.mktemp("http_logs"),
                        router_args=["--http-port", str(port)],
                        role_args={"decode": ["--metrics-port", str(decode_metrics_port)]})
    stack.http_url = f"http://127.0.0.1:{port}"
    stack.decode_metrics_url = f"http://127.0.0.1:{decode_metrics_port}/metrics"
    yield stack
    stop(stack.processes)


@pytest.fixture(scope="module")
def client(http_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http_stack.http_url}/v1", api_key="unused",
                         max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _get(url: str, headers: dict | None = None) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                    timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _num_aborted(stack) -> float:
    """Requests the decode worker ended as aborted (its Prometheus counter)."""
    return _num_finished(stack, "abort")


def _num_finished(stack, status: str) -> float:
    """Requests the decode worker ended with `status` (its Prometheus counter)."""
    with urllib.request.urlopen(stack.decode_metrics_url, timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("tandem:requests_finished_total{") \
                    and f'status="{status}"' in line:
                return float(line.split()[-1])
    return 0.0


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, bytes]:
    """A raw JSON POST: (status, body bytes), the body read to its end."""
    host, port = url.removeprefix("http://").split("/", 1)[0].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request("POST", "/" + url.split("/", 3)[3], json.dumps(body),
                           {"Content-Type": "application/json", **(headers or {})})
        reply = connection.getresponse()
        return reply.status, reply.read()
    finally:
        connection.close()


def _workers_idle(stack) -> bool:
    loads = [worker_load(w.address) for w in stack.workers.values()]
    return all(l.kv_usage == 0 and l.num_running == 0 and l.num_pinned == 0 for l in loads)


def test_models_health_and_version(http_stack, client, checkpoint):
    models = client.models.list().data
    assert [m.id for m in models] == [checkpoint("llama").path.name]
    assert models[0].object == "model" and models[0].owned_by == "tandem"
    assert _get(f"{http_stack.http_url}/health") == (200, {"status": "ok"})
    status, body = _get(f"{http_stack.http_url}/version")
    assert status == 200 and body["version"]


def test_chat_completion_equals_the_grpc_answer(http_stack, client, model):
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        **GREEDY)
    grpc_result = generate(http_stack.router.address, generate_pb2.GenerateRequest(
        chat=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="user",
                                                                          content="hi")]),
        sampling=generate_pb2.SamplingParameters(temperature=0.0),
        stop=generate_pb2.StopConditions(max_tokens=12, min_tokens=12)))
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert reply.model == model and len(reply.choices) == 1
    choice = reply.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == grpc_result.text
    assert choice.finish_reason == "length" and choice.logprobs is None
    usage = reply.usage
    assert usage.completion_tokens == 12
    assert usage.prompt_tokens == grpc_result.complete.usage.prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + 12
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_matches_the_whole_answer_and_ends_with_usage(client, model):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hey"}]
    whole = client.chat.completions.create(model=model, messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_text_and_token_ids_stream_and_not(http_stack, client, model):
    ids = [5, 17, 42, 99, 7, 3]
    whole = client.completions.create(model=model, prompt=ids, **GREEDY)
    grpc_result = generate(http_stack.router.address, request(ids, max_tokens=12))
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
    assert whole.choices[0].text == grpc_result.text
    assert whole.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(model=model, prompt=ids, stream=True, **GREEDY))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == grpc_result.text
    assert chunks[-1].choices[0].finish_reason == "length"
    text = client.completions.create(model=model, prompt="The quick brown fox", **GREEDY)
    assert text.choices[0].text == generate(http_stack.router.address,
                                            request("The quick brown fox", max_tokens=12)).text


def test_n_choices_with_a_seed_are_reproducible_and_distinct(client, model):
    def sample(stream: bool) -> list[str]:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "tell me"}], n=2, seed=7,
            temperature=1.0, max_tokens=16, stream=stream, extra_body={"min_tokens": 16})
        if not stream:
            return [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)]
        texts = ["", ""]
        for chunk in reply:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
        return texts

    first = sample(stream=False)
    assert len(first) == 2 and first[0] != first[1]  # seeds 7 and 8
    assert sample(stream=False) == first
    assert sample(stream=True) == first


def test_logprobs_in_openai_format(client, model):
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], logprobs=True,
        top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 12
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.bytes == list(entry.token.encode())
        # Greedy: the sampled token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
    text = client.completions.create(model=model, prompt=[5, 6, 7], logprobs=2, **GREEDY)
    logprobs = text.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 12
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
    assert "".join(logprobs.tokens).replace("\ufffd", "") \
        .startswith(text.choices[0].text[:1].replace("\ufffd", ""))


def test_stop_string_ends_the_text_before_it(client, model):
    ids = [11, 12, 13, 14]
    full = client.completions.create(model=model, prompt=ids, **GREEDY).choices[0].text
    assert len(full) >= 6, full
    stop = full[3:6]
    reply = client.completions.create(model=model, prompt=ids, stop=[stop], **GREEDY)
    assert reply.choices[0].text == full[:full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_repeated_prompt_reports_cached_tokens(client, model):
    ids = list(range(1, 65))  # four full 16-token blocks
    first = client.completions.create(model=model, prompt=ids, max_tokens=2)
    second = client.completions.create(model=model, prompt=ids, max_tokens=2)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == 64
    assert second.usage.prompt_tokens_details.cached_tokens >= 48


@pytest.mark.parametrize("fields, param", [
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
])
def test_unsupported_field_is_a_400_naming_it(client, model, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, extra_body=fields)
    assert info.value.status_code == 400 and param in info.value.message
    assert info.value.body["param"] == param


@pytest.mark.parametrize("fields, status, param", [
    ({"temperature": -1.0}, 400, "temperature"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"n": 0}, 400, "n"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"model": "no-such-model"}, 404, "model"),
])
def test_bad_values_get_a_status_naming_the_field(client, model, fields, status, param):
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            **fields}
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**body)
    assert info.value.status_code == status
    assert info.value.body["param"] == param, info.value.body
    assert info.value.body["type"] in ("invalid_request_error", "not_found_error")


def test_out_of_vocabulary_prompt_is_a_400(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=[1, 2, 100_000], max_tokens=2)
    assert "outside the vocabulary" in info.value.message
    assert info.value.body["code"] == "OUT_OF_RANGE"


def test_disconnect_mid_stream_frees_kv_on_every_worker(http_stack, client, model):
    num_aborted = _num_aborted(http_stack)
    stream = client.completions.create(model=model, prompt="The quick brown fox",
                                       max_tokens=450, temperature=0.0, stream=True,
                                       extra_body={"min_tokens": 450})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert not _workers_idle(http_stack)  # mid-stream: the decode worker holds blocks
    stream.close()
    deadline = time.monotonic() + 5.0
    while not _workers_idle(http_stack):
        assert time.monotonic() < deadline, "KV still held after the client went away"
        time.sleep(0.05)
    # Aborted, not run to its 450 tokens. The worker exports its counters on engine steps:
    # one more request brings the count up to date.
    client.completions.create(model=model, prompt=[1, 2], max_tokens=2)
    assert _num_aborted(http_stack) == num_aborted + 1


def test_a_client_that_closes_before_a_whole_completion_aborts_it(http_stack, model):
    num_aborted = _num_aborted(http_stack)
    host, port = http_stack.http_url.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "prompt": "The quick brown fox", "max_tokens": 500,
                       "min_tokens": 500, "temperature": 0})
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.request("POST", "/v1/completions", body,
                       {"Content-Type": "application/json"})
    # Wait until the request decodes, then hang up without reading the answer.
    decode = http_stack.workers["decode-0"].address
    deadline = time.monotonic() + 10.0
    while worker_load(decode).num_running == 0:
        assert time.monotonic() < deadline, "the request never reached the decode worker"
        time.sleep(0.01)
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    deadline = time.monotonic() + 5.0
    while not _workers_idle(http_stack):
        assert time.monotonic() < deadline, "KV still held after the client went away"
        time.sleep(0.05)
    openai.OpenAI(base_url=f"{http_stack.http_url}/v1", api_key="unused").completions.create(
        model=model, prompt=[1, 2], max_tokens=2)  # the worker exports its counters on steps
    assert _num_aborted(http_stack) == num_aborted + 1


def test_tokenize_counts_the_prompt_as_a_completion_does(http_stack, client, model):
    url = http_stack.http_url
    prompt = "The quick brown fox"
    status, body = _post(f"{url}/v1/tokenize", {"model": model, "prompt": prompt})
    tokens = json.loads(body)
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    assert status == 200 and tokens["max_model_len"] > 0
    assert tokens["count"] == len(tokens["tokens"]) == reply.usage.prompt_tokens
    messages = [{"role": "user", "content": "hey"}]
    status, body = _post(f"{url}/v1/tokenize", {"messages": messages})
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert status == 200 and json.loads(body)["count"] == chat.usage.prompt_tokens
    status, body = _post(f"{url}/v1/detokenize", {"model": model, "tokens": tokens["tokens"]})
    assert status == 200 and json.loads(body)["prompt"].endswith(prompt)


@pytest.mark.parametrize("path, body, status, param", [
    ("tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400,
     "prompt"),
    ("tokenize", {}, 400, "prompt"),
    ("tokenize", {"model": "other", "prompt": "hi"}, 404, "model"),
    ("tokenize", {"prompt": "hi", "add_special_tokens": False}, 400, "add_special_tokens"),
    ("detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
])
def test_tokenize_refusals_name_the_field(http_stack, path, body, status, param):
    got, reply = _post(f"{http_stack.http_url}/v1/{path}", body)
    assert (got, json.loads(reply)["error"]["param"]) == (status, param)


def test_return_token_ids_name_each_chunks_tokens(http_stack, client, model):
    ids = [5, 17, 42, 99]
    extra = {"min_tokens": 12, "return_token_ids": True}
    expected = generate(http_stack.router.address, request(ids, max_tokens=12)).token_ids
    whole = client.completions.create(model=model, prompt=ids, temperature=0.0, max_tokens=12,
                                      extra_body=extra)
    assert whole.to_dict()["choices"][0]["token_ids"] == expected
    chunks = [c.to_dict() for c in client.completions.create(
        model=model, prompt=ids, temperature=0.0, max_tokens=12, extra_body=extra,
        stream=True)]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == expected
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                          temperature=0.0, max_tokens=12, extra_body=extra)
    assert len(chat.to_dict()["choices"][0]["token_ids"]) == 12
    plain = client.completions.create(model=model, prompt=ids, max_tokens=2)
    assert "token_ids" not in plain.to_dict()["choices"][0]


def test_a_passed_deadline_is_a_504_and_the_workers_abort(http_stack, client, model):
    """X-Request-Timeout bounds the request: a whole completion gets a 504; a stream gets a
    504 (deadline before its first token) or an error event. Neither runs on to its end."""
    num_finished = _num_finished(http_stack, "length")
    long = {"model": model, "prompt": "The quick brown fox", "max_tokens": 450,
            "min_tokens": 450, "temperature": 0.0}
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=model, prompt=long["prompt"], max_tokens=450,
                                  temperature=0.0, extra_body={"min_tokens": 450},
                                  extra_headers={"X-Request-Timeout": "0.5"})
    assert info.value.status_code == 504 and info.value.body["code"] == "DEADLINE_EXCEEDED"
    status, body = _post(f"{http_stack.http_url}/v1/completions", {**long, "stream": True},
                         {"X-Request-Timeout": "0.5"})
    if status == 200:
        events = [line for line in body.decode().split("\n\n") if line]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] \
            == "DEADLINE_EXCEEDED"
    else:
        assert status == 504 and json.loads(body)["error"]["code"] == "DEADLINE_EXCEEDED"
    deadline = time.monotonic() + 30.0
    while not _workers_idle(http_stack):
        assert time.monotonic() < deadline, "KV still held after the deadline passed"
        time.sleep(0.05)
    # Whether the deadline caught a request in prefill or in decode varies with the box's
    # speed; either way neither may have run on to its 450 tokens (an unaborted request would
    # finish as "length", or hold KV past the wait above).
    client.completions.create(model=model, prompt=[1, 2], max_tokens=2)  # counters refresh
    assert _num_finished(http_stack, "length") == num_finished + 1  # only this last one


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan"])
def test_a_bad_timeout_header_is_a_400_naming_it(http_stack, model, value):
    status, body = _post(f"{http_stack.http_url}/v1/completions",
                         {"model": model, "prompt": [1, 2], "max_tokens": 2},
                         {"X-Request-Timeout": value})
    assert (status, json.loads(body)["error"]["param"]) == (400, "X-Request-Timeout")


def test_tandem_bench_over_http_counts_what_grpc_counts(http_stack):
    config = BenchmarkConfig(router=http_stack.router.address, http=http_stack.http_url,
                             concurrency=2, num_requests=4, warmup=1, input_len="8",
                             output_len="6")
    over_http = run_benchmark(config)
    over_grpc = run_benchmark(dataclasses.replace(config, http=None))
    for result in (over_http, over_grpc):
        stats = result.stats
        assert (stats["num_ok"], stats["total_output_tokens"]) == (4, 24), stats["errors"]
        assert stats["ttft_s"]["count"] == stats["tpot_s"]["count"] == 4
        assert {r.finish_reason for r in result.records} == {"length"}
    assert over_http.stats["total_prompt_tokens"] == over_grpc.stats["total_prompt_tokens"]
    assert http_stack.http_url in over_http.table()


def test_tandem_bench_http_cli_records_deadline_errors(http_stack, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_main(["--http", http_stack.http_url, "--num-requests", "2", "--input-len",
                       "4", "--output-len", "3", "--no-progress", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["stats"]["num_ok"] == 2
    # A deadline far shorter than 400 tokens take: each request fails with the router's 504.
    assert bench_main(["--http", http_stack.http_url, "--num-requests", "2", "--input-len",
                       "4", "--output-len", "400", "--timeout", "0.3", "--no-progress",
                       "--json", str(out)]) == 1
    assert json.loads(out.read_text())["stats"]["errors"] == {"DEADLINE_EXCEEDED": 2}


def test_http_vs_grpc_prints_both_rows_and_their_ratios(http_stack):
    import asyncio

    stack = Target(http_stack.router.address, http_stack.http_url)
    base = BenchmarkConfig(router=stack.router, num_requests=2, input_len="8", output_len="4")
    runs = asyncio.run(measure(stack, base, concurrency=2, rounds=2))
    rows = {name: summarize_runs(runs[name]) for name in ("grpc", "http")}
    assert [len(runs[name]) for name in ("grpc", "http")] == [2, 2]
    assert rows["grpc"]["num_ok"] == rows["http"]["num_ok"] == 4
    verdicts = ratios(rows, runs)
    assert len(verdicts["tpot_s"]["round_ratios"]) == 2 and verdicts["router_cpu"] is None
    table = format_table({2: {**rows, "ratios": verdicts}})
    assert "   2 grpc" in table and "   2 http" in table and "   2 HTTP/gRPC TTFT" in table


@pytest.fixture(scope="module")
def guarded_router(http_stack, checkpoint, tmp_path_factory):
    """A second router on the same workers, requiring a bearer token on HTTP and gRPC, and
    admitting one request at a time with no queue."""
    log_dir = tmp_path_factory.mktemp("guarded_logs")
    (log_dir / "token").write_text(TOKEN + "\n")
    (log_dir / "internal").write_text("internal-unused\n")
    port, http_port = free_port(), free_port()
    workers = http_stack.workers
    router = start("guarded-router", [
        "tandem.router.server", "--model", str(checkpoint("llama").path), "--port", str(port),
        "--http-port", str(http_port), "--auth-token-file", str(log_dir / "token"),
        "--internal-token-file", str(log_dir / "internal"), "--max-concurrency", "1",
        "--max-queue", "0",
        "--prefill", workers["prefill-0"].address, "--decode", workers["decode-0"].address],
        port, log_dir)
    try:
        wait_serving([router])
        yield f"http://127.0.0.1:{http_port}"
    finally:
        stop([router])


def test_bearer_token_guards_the_api_but_not_health(guarded_router):
    anonymous = openai.OpenAI(base_url=f"{guarded_router}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        anonymous.models.list()
    assert info.value.status_code == 401
    assert _get(f"{guarded_router}/v1/models")[0] == 401  # no Authorization header at all
    authorized = openai.OpenAI(base_url=f"{guarded_router}/v1", api_key=TOKEN, max_retries=0)
    model = authorized.models.list().data[0].id
    reply = authorized.completions.create(model=model, prompt=[1, 2, 3], max_tokens=3)
    assert reply.usage.completion_tokens >= 1
    assert _get(f"{guarded_router}/health")[0] == 200



def test_a_full_router_answers_429_with_retry_after(guarded_router):
    client = openai.OpenAI(base_url=f"{guarded_router}/v1", api_key=TOKEN, max_retries=0)
    model = client.models.list().data[0].id
    stream = client.completions.create(model=model, prompt="The quick brown fox",
                                       max_tokens=450, stream=True,
                                       extra_body={"min_tokens": 450})
    try:
        next(iter(stream))  # it holds the only slot now
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=model, prompt=[1, 2], max_tokens=2)
        assert info.value.status_code == 429 and info.value.body["code"] == "RESOURCE_EXHAUSTED"
        assert int(info.value.response.headers["retry-after"]) >= 1
    finally:
        stream.close()


def test_no_workers_is_503_and_health_says_so(checkpoint, tmp_path):
    port, http_port = free_port(), free_port()
    router = start("lonely-router", [
        "tandem.router.server", "--model", str(checkpoint("llama").path), "--port", str(port),
        "--http-port", str(http_port), "--both", f"127.0.0.1:{free_port()}"], port, tmp_path)
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, body = _get(f"{url}/health")
                break
            except OSError:  # not listening yet
                assert router.is_alive() and time.monotonic() < deadline, router.log_tail()
                time.sleep(0.2)
        assert (status, body) == (503, {"status": "unavailable"})
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=checkpoint("llama").path.name, prompt=[1, 2],
                                      max_tokens=2)
        assert info.value.status_code == 503 and info.value.body["code"] == "UNAVAILABLE"
        assert "no healthy workers" in info.value.message
    finally:
        stop([router])

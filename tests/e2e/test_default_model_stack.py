"""The quickstart path on one `tandem up --http-port` with no --model (the default model,
started once for this module): `tandem generate --chat` streams an answer containing "Paris"
that equals the offline answer, the official `openai` client gets the same answer token for
token as gRPC, and the stack exits 0 on SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import openai
import pytest
from helpers.client import generate
from helpers.processes import free_port, start_up
from transformers import AutoTokenizer

from tandem import LLM, SamplingParams
from tandem.common.default_model import DEFAULT_MODEL_NAME
from tandem.v1 import generate_pb2

QUESTION = "What is the capital of France?"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def default_up(default_model_cache, tmp_path_factory):
    """(router gRPC address, HTTP base URL, log folder) of `tandem up --http-port` serving the
    default model; its SIGTERM exit status is checked when the module ends."""
    log_dir = tmp_path_factory.mktemp("default_up")
    http_port = free_port()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TANDEM_CACHE_DIR", str(default_model_cache))
        # One max_model_len of KV: on CPU the default cache (2 GiB a worker) takes seconds to zero.
        up, processes = start_up(["--http-port", str(http_port), "--num-kv-blocks", "512"],
                                 log_dir)
    try:
        assert "router" in processes, (log_dir / "up.log").read_text()[-3000:]
        yield processes["router"][0], f"http://127.0.0.1:{http_port}/v1", log_dir
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0, (log_dir / "up.log").read_text()[-3000:]


@pytest.mark.slow
def test_generate_chat_streams_paris_equal_to_the_offline_answer(default_up,
                                                                  default_model_cache):
    router, _, _ = default_up
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "generate", "--router", router,
         "--chat", QUESTION, "--max-tokens", str(MAX_TOKENS)],
        capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "ttft" in result.stderr.lower()
    # The same answer as the offline engine on the same converted folder.
    llm = LLM(default_model_cache / "models" / DEFAULT_MODEL_NAME, dtype="float32")
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True,
        return_dict=False)
    [offline] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert result.stdout.strip() == offline.text.strip()


@pytest.mark.slow
def test_http_chat_answer_equals_the_grpc_answer(default_up, default_model_cache):
    router, base_url, _ = default_up
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], temperature=0,
        max_tokens=MAX_TOKENS, logprobs=True)
    grpc_result = generate(router, generate_pb2.GenerateRequest(
        chat=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(
            role="user", content=QUESTION)]),
        sampling=generate_pb2.SamplingParameters(temperature=0),
        stop=generate_pb2.StopConditions(max_tokens=MAX_TOKENS), logprobs=0), timeout=120)
    text = reply.choices[0].message.content
    assert "Paris" in text
    assert text == grpc_result.text
    # Token for token: the HTTP logprobs name the same tokens gRPC streamed.
    tokens = [entry.token for entry in reply.choices[0].logprobs.content]
    assert len(tokens) == len(grpc_result.token_ids) == reply.usage.completion_tokens
    tokenizer = AutoTokenizer.from_pretrained(
        str(default_model_cache / "models" / model), local_files_only=True)
    assert tokens == [tokenizer.decode([t]) for t in grpc_result.token_ids]

"""The quickstart over HTTP: `tandem up --http-port` with the default model answers the
official `openai` client, token for token as over gRPC."""
from __future__ import annotations

import signal

import openai
import pytest
from helpers.client import generate
from helpers.processes import free_port, start_up

from transformers import AutoTokenizer

from tandem.v1 import generate_pb2

QUESTION = "What is the capital of France?"


@pytest.mark.slow
def test_http_chat_answer_equals_the_grpc_answer_on_the_default_model(default_model_cache,
                                                                      tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(default_model_cache))
    http_port = free_port()
    up, processes = start_up(["--http-port", str(http_port)], tmp_path)
    try:
        assert "router" in processes, (tmp_path / "up.log").read_text()[-3000:]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused",
                               max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTION}], temperature=0,
            max_tokens=24, logprobs=True)
        grpc_result = generate(processes["router"][0], generate_pb2.GenerateRequest(
            chat=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(
                role="user", content=QUESTION)]),
            sampling=generate_pb2.SamplingParameters(temperature=0),
            stop=generate_pb2.StopConditions(max_tokens=24), logprobs=0), timeout=120)
        text = reply.choices[0].message.content
        assert "Paris" in text
        assert text == grpc_result.text
        # Token for token: the HTTP logprobs name the same tokens gRPC streamed.
        tokens = [entry.token for entry in reply.choices[0].logprobs.content]
        assert len(tokens) == len(grpc_result.token_ids) == reply.usage.completion_tokens
        tokenizer = AutoTokenizer.from_pretrained(
            str(default_model_cache / "models" / model), local_files_only=True)
        assert tokens == [tokenizer.decode([t]) for t in grpc_result.token_ids]
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0

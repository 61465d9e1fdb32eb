"""A client that reads slowly gets the same tokens in fewer, larger chunks: while its stream
cannot take the next message (HTTP/2 flow control), the router folds every token that arrives
for the request into one chunk instead of queueing a message per worker update.

The real router runs in front of the router microbenchmark's fake worker (a real gRPC server
of the worker protocol, stepping one token per request every few milliseconds).
"""
from __future__ import annotations

import asyncio

import grpc
import pytest
from helpers.processes import free_port, start, stop, wait_serving
from helpers.standin_server import serve
from transformers import AutoTokenizer

from tandem.bench.router_fakes import FakeWorker, corpus_text
from tandem.v1 import generate_pb2, generate_pb2_grpc

NUM_TOKENS = 200
STEP_SECONDS = 0.005
# A client whose receive window holds a few dozen chunks: once it is full, the router's next
# write waits until the client reads.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


@pytest.fixture(scope="module")
def relay(checkpoint, tmp_path_factory):
    """(router address, the fake worker's token ids, tokenizer)."""
    model = checkpoint("llama").path
    tokenizer = AutoTokenizer.from_pretrained(model)
    token_ids = tokenizer.encode(corpus_text(4), add_special_tokens=False)
    worker = FakeWorker(token_ids, STEP_SECONDS, model.name)

    def register(server):
        worker.register(server)
        asyncio.get_running_loop().create_task(worker.run_steps())

    with serve(register) as worker_address:
        port = free_port()
        router = start("router", ["tandem.router.server", "--model", str(model), "--port",
                                  str(port), "--processes", "1", "--both", worker_address],
                       port, tmp_path_factory.mktemp("coalescing_logs"))
        try:
            wait_serving([router])
            yield router.address, token_ids, tokenizer
        finally:
            stop([router])


def read_stream(address: str, read_delay: float, options=()) -> list[generate_pb2.Chunk]:
    """The chunks that carried tokens, reading one every `read_delay` seconds."""
    async def main():
        async with grpc.aio.insecure_channel(address, options=list(options)) as channel:
            request = generate_pb2.GenerateRequest(
                text="Tell me a story.", sampling=generate_pb2.SamplingParameters(temperature=0),
                stop=generate_pb2.StopConditions(max_tokens=NUM_TOKENS))
            chunks = []
            async for response in generate_pb2_grpc.GenerateStub(channel).Generate(
                    request, timeout=120):
                if response.HasField("chunk"):
                    chunks.append(response.chunk)
                    await asyncio.sleep(read_delay)
            return chunks
    return asyncio.run(main())


def assert_whole_stream(chunks, token_ids: list[int], tokenizer) -> list[int]:
    """The stream carries NUM_TOKENS consecutive tokens of the fake worker's walk, and their
    text; returns the tokens per chunk."""
    streamed = [t for c in chunks for t in c.token_ids]
    assert len(streamed) == NUM_TOKENS
    walk = token_ids * 2  # the worker walks the list from any point, wrapping around
    assert any(walk[start:start + NUM_TOKENS] == streamed for start in range(len(token_ids)))
    assert "".join(c.text for c in chunks) == tokenizer.decode(streamed)
    return [len(c.token_ids) for c in chunks if c.token_ids]


@pytest.mark.slow
def test_a_slow_client_gets_the_same_tokens_in_fewer_larger_chunks(relay):
    address, token_ids, tokenizer = relay
    prompt_reader = assert_whole_stream(read_stream(address, 0.0), token_ids, tokenizer)
    # 200 chunks at 50 ms a read would take 10 s; the tokens come in 1 s.
    slow_reader = assert_whole_stream(read_stream(address, 0.05, SMALL_WINDOW), token_ids,
                                      tokenizer)
    assert sum(prompt_reader) == sum(slow_reader) == NUM_TOKENS
    assert len(slow_reader) <= NUM_TOKENS // 2, slow_reader
    assert max(slow_reader) >= 5, slow_reader

"""tandem bench's shared-prefix workloads (multi-turn chat, shared prefix) against a stand-in
router that caches prefixes as one worker would, and the hit rate in the report."""
from __future__ import annotations

import asyncio
import itertools

import pytest
from helpers.standin_server import serve_generate

from tandem.bench import BenchmarkConfig, run_benchmark
from tandem.bench.prefix_workloads import ideal_cached_tokens
from tandem.v1 import generate_pb2 as pb
from tandem.v1 import generate_pb2_grpc

VOCAB_SIZE, EOS_ID, BLOCK = 500, 2, 16


class OneWorkerCache(generate_pb2_grpc.GenerateServicer):
    """Replies with counting tokens; reports as cached the longest prefix (in full blocks,
    leaving one token) of any earlier prompt plus reply whose KV it computed."""

    def __init__(self) -> None:
        self.computed: list[list[int]] = []
        self.prompts: list[list[int]] = []
        self.counter = itertools.count(1000)

    async def Generate(self, request, context):
        prompt = list(request.token_ids.ids)
        self.prompts.append(prompt)
        reply = [next(self.counter) % VOCAB_SIZE or 3 for _ in range(request.stop.max_tokens)]
        reusable = max((_common(prompt, seen) for seen in self.computed), default=0)
        self.computed.append(prompt + reply[:-1])
        yield pb.GenerateResponse(chunk=pb.Chunk(text="x", token_ids=reply))
        await asyncio.sleep(0.001)
        yield pb.GenerateResponse(complete=pb.Complete(
            request_id=request.request_id, finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=len(prompt), completion_tokens=len(reply),
                           cached_prompt_tokens=ideal_cached_tokens(reusable, len(prompt)))))

    async def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(model="scripted", max_model_len=2048,
                                       vocab_size=VOCAB_SIZE, eos_token_ids=[EOS_ID])


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_ideal_counts_full_blocks_and_leaves_a_token():
    assert ideal_cached_tokens(100, 200) == 96
    assert ideal_cached_tokens(100, 97) == 96
    assert ideal_cached_tokens(100, 96) == 80
    assert ideal_cached_tokens(15, 200) == 0


def test_chat_resends_each_conversations_history_with_the_real_replies():
    servicer = OneWorkerCache()
    with serve_generate(servicer) as address:
        result = run_benchmark(BenchmarkConfig(
            router=address, workload="chat", conversations=3, turns=4, system_prompt_len=40,
            input_len="20", output_len="8", think_time_s=0.01))
    stats = result.stats
    assert stats["num_ok"] == 12
    by_system = {}
    for prompt in servicer.prompts:
        by_system.setdefault(tuple(prompt[:40]), []).append(prompt)
    assert len(by_system) == 3 and all(len(turns) == 4 for turns in by_system.values())
    for turns in by_system.values():
        for previous, current in zip(turns, turns[1:]):
            assert len(current) == len(previous) + 8 + 20
            assert current[:len(previous)] == previous
    # One worker that caches everything reaches the ideal exactly.
    assert stats["total_cached_prompt_tokens"] == stats["ideal_cached_prompt_tokens"] > 0
    assert 0 < stats["prefix_cache_hit_rate"] < 1
    assert "Prefix cache hit rate" in result.table() and "1.00x ideal" in result.table()
    first_turns = [r for r in result.records if r.ideal_cached_tokens == 0]
    assert len(first_turns) == 3


def test_chat_with_a_shared_system_prompt_starts_every_conversation_with_it():
    servicer = OneWorkerCache()
    with serve_generate(servicer) as address:
        result = run_benchmark(BenchmarkConfig(
            router=address, workload="chat", conversations=3, turns=3, system_prompt_len=40,
            shared_system_prompt=True, input_len="20", output_len="8", think_time_s=0.01))
    assert result.stats["num_ok"] == 9
    assert len({tuple(prompt[:40]) for prompt in servicer.prompts}) == 1
    assert len({tuple(prompt[:60]) for prompt in servicer.prompts}) == 3  # own user messages
    # Every turn after the first reply reuses at least the system prompt's full blocks.
    ideals = sorted(r.ideal_cached_tokens for r in result.records)
    assert ideals[0] == 0 and ideals[-1] > 32
    assert result.stats["total_cached_prompt_tokens"] >= result.stats[
        "ideal_cached_prompt_tokens"] >= 6 * 32
    assert "shared system prompts" in result.config.load_shape()


def test_shared_prefix_groups_share_their_prefix():
    servicer = OneWorkerCache()
    with serve_generate(servicer) as address:
        result = run_benchmark(BenchmarkConfig(
            router=address, workload="shared-prefix", groups=2, prefix_len=64,
            input_len="10", output_len="4", concurrency=1, num_requests=10))
    prefixes = {tuple(p[:64]) for p in servicer.prompts}
    assert len(prefixes) == 2 and all(len(p) == 74 for p in servicer.prompts)
    ideal = result.stats["ideal_cached_prompt_tokens"]
    assert ideal == (10 - 2) * 64
    assert result.stats["total_cached_prompt_tokens"] >= ideal


@pytest.mark.parametrize("fields, message", [
    (dict(workload="nope"), "workload"),
    (dict(workload="chat", concurrency=4), "conversations"),
    (dict(workload="chat", turns=0), "turns"),
    (dict(workload="chat", think_time_s=-1), "think_time_s"),
    (dict(workload="shared-prefix", prompts_file="x.jsonl"), "prompts file"),
])
def test_bad_workload_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        BenchmarkConfig(**fields)


def test_routing_overhead_microbenchmark_runs(capsys):
    from tandem.bench.routing_overhead import main

    assert main(["--workers", "3", "--blocks", "300", "--prompt-len", "64", "--block-size",
                 "4", "--requests", "5"]) == 0
    out = capsys.readouterr().out
    assert "3 workers, " in out and "p99" in out
    for row in ("pick, new tail", "pick, next turn", "pick, held whole", "least-loaded pick",
                "hash all blocks"):
        assert row in out

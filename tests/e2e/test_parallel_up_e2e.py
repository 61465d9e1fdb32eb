"""TP=2 and TP=2 + EP=2 through `tandem up` itself (its own worker and router processes, each
worker rank 0 + one follower over gloo): a dense and an MoE tiny model give transformers'
greedy tokens (what TP=1 gives: tests/e2e/test_generate_e2e.py), every worker ends with no KV
block in use, and a SIGTERM to `tandem up` stops every process, followers included."""
from __future__ import annotations

import signal

import pytest
from helpers.checkpoints import random_prompts
from helpers.client import generate, request, worker_load
from helpers.processes import child_pids, start_up, wait_gone


@pytest.mark.parametrize("variant,parallel", [
    ("llama", ["--tensor-parallel-size", "2"]),
    ("qwen3_moe", ["--tensor-parallel-size", "2", "--enable-expert-parallel"]),
])
def test_tandem_up_with_parallel_workers_gives_transformers_tokens(checkpoint, moe_checkpoint,
                                                                  tmp_path, variant, parallel):
    ckpt = moe_checkpoint(variant) if variant == "qwen3_moe" else checkpoint(variant)
    up, processes = start_up(["--model", str(ckpt.path), "--dtype", "float32", *parallel],
                             tmp_path)
    children = child_pids(up.pid)  # the router and the workers (rank 0 of each)
    followers = [pid for child in children for pid in child_pids(child)]
    try:
        assert set(processes) == {"router", "prefill-0", "decode-0"}, \
            (tmp_path / "up.log").read_text()[-3000:]
        assert len(followers) == 2, "one follower rank per worker"
        for prompt in random_prompts([3, 50], seed=23):
            result = generate(processes["router"][0], request(prompt, max_tokens=12))
            assert result.token_ids == ckpt.greedy(prompt, 12), f"{len(prompt)}-token prompt"
        for name in ("prefill-0", "decode-0"):
            load = worker_load(processes[name][0])
            assert load.kv_usage == 0 and load.num_pinned == 0
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    wait_gone([*children, *followers], timeout=10)

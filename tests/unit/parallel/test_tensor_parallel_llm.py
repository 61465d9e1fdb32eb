"""Offline LLM with tensor_parallel_size=2 (this process is rank 0, one follower process over
gloo): greedy tokens equal TP=1's and transformers'; bad sizes fail before anything starts;
shutdown leaves no follower behind."""
from __future__ import annotations

import os

import pytest
from helpers.checkpoints import random_prompts

from tandem import LLM, SamplingParams

NUM_NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
# 1-token, single-block, multi-block and chunked (max_num_batched_tokens=64) prompts together.
LENGTHS = [1, 7, 40, 130]


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# qwen3: 2 KV heads split 1 per rank (and QK norm per head); llama_rope3: 1 KV head,
# replicated on both ranks; llama_sharded: biases on q/k/v/o (o's added once, after the sum).
@pytest.mark.parametrize("variant", ["qwen3", "llama_rope3", "llama_sharded"])
def test_tp2_greedy_tokens_equal_tp1_and_transformers(checkpoint, variant):
    ckpt = checkpoint(variant)
    prompts = random_prompts(LENGTHS, seed=91)
    single = LLM(ckpt.path, dtype="float32", max_num_batched_tokens=64)
    expected = [out.token_ids for out in single.generate(prompts, GREEDY)]
    with LLM(ckpt.path, dtype="float32", max_num_batched_tokens=64,
             tensor_parallel_size=2) as llm:
        [follower_pid] = llm.engine.executor.rank_group.followers.pids
        num_kv_heads = single.engine.runner.kv_caches[0][0].shape[2]
        assert llm.engine.runner.kv_caches[0][0].shape[2] == max(1, num_kv_heads // 2)
        actual = [out.token_ids for out in llm.generate(prompts, GREEDY)]
    assert actual == expected
    assert actual == [ckpt.greedy(p, NUM_NEW_TOKENS) for p in prompts]
    assert not is_running(follower_pid)


def test_sizes_that_do_not_split_the_model_are_refused_naming_the_field(checkpoint):
    ckpt = checkpoint("llama")  # 4 attention heads, 2 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*num_attention_heads=4"):
        LLM(ckpt.path, dtype="float32", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        LLM(ckpt.path, dtype="float32", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        LLM(ckpt.path, dtype="float32", enable_expert_parallel="yes")


def test_a_kv_cache_that_cannot_hold_max_model_len_fails_as_a_value_error_under_tp(checkpoint):
    """Rank 0's sizing fails after its follower started: the ValueError reaches the caller and
    the follower is stopped."""
    from helpers.processes import child_pids

    ckpt = checkpoint("llama")
    before = set(child_pids(os.getpid()))  # e.g. multiprocessing's resource tracker
    with pytest.raises(ValueError, match="num_kv_blocks=2 holds 32 tokens"):
        LLM(ckpt.path, dtype="float32", num_kv_blocks=2, max_model_len=256,
            tensor_parallel_size=2)
    assert not [pid for pid in set(child_pids(os.getpid())) - before if is_running(pid)]

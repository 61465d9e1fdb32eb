"""Prefill CUDA graphs (workers/engine/prefill_graphs.py): a lone prompt's step replays a graph
padded to its bucket (fresh, first chunk, MLA, over a cached prefix in bf16) and gives
transformers' tokens; steps of several prompts, and fp32 steps over cached context, run
eagerly."""
from __future__ import annotations

import pytest
from helpers.checkpoints import build_checkpoint, random_prompts
from helpers.mla_checkpoints import MLA_BASE
from test_engine_on_gpu import _aiter_or_skip

from tandem import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
# Buckets 128, 192, 256; 300 runs eagerly, and a one-token prompt is a decode-shaped step
# (the decode graphs take it).
LENGTHS = [1, 7, 100, 128, 129, 193, 256, 300]


@pytest.mark.parametrize("fixture, name", [("checkpoint", "qwen3"),
                                           ("moe_checkpoint", "qwen3_moe"),
                                           ("moe_checkpoint", "mixtral")])
def test_lone_prompts_replay_prefill_graphs_with_transformers_tokens(request, fixture, name):
    _aiter_or_skip()
    ckpt = request.getfixturevalue(fixture)(name)
    llm = LLM(ckpt.path, dtype="float32", device="cuda", kernels="aiter-triton",
              max_num_seqs=4, prefill_graph_tokens=256, enable_prefix_caching=False)
    graphs = llm.engine.runner.prefill_graphs
    assert graphs is not None and graphs.buckets == [128, 192, 256]
    for prompt in random_prompts(LENGTHS, seed=41):
        before = graphs.num_replays
        assert llm.generate([prompt], GREEDY)[0].token_ids == ckpt.greedy(prompt, 8), len(prompt)
        assert graphs.num_replays == before + (1 < len(prompt) <= 256), len(prompt)
    # Several prompts in one step: eager, and still right.
    prompts = random_prompts([50, 120], seed=42)
    before = graphs.num_replays
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert out.token_ids == ckpt.greedy(prompt, 8)
    assert graphs.num_replays == before
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_prefix_hit_runs_eagerly_and_switch_turns_graphs_off(checkpoint):
    _aiter_or_skip()
    ckpt = checkpoint("llama")
    prompt = random_prompts([200], seed=43)[0]
    llm = LLM(ckpt.path, dtype="float32", device="cuda", kernels="aiter-triton",
              max_num_seqs=4, prefill_graph_tokens=256)
    graphs = llm.engine.runner.prefill_graphs
    assert llm.generate([prompt], GREEDY)[0].token_ids == ckpt.greedy(prompt, 8)
    replays = graphs.num_replays
    assert replays == 1
    # The same prompt again hits the prefix cache: the step's queries are not all its keys.
    assert llm.generate([prompt], GREEDY)[0].token_ids == ckpt.greedy(prompt, 8)
    assert graphs.num_replays == replays
    off = LLM(ckpt.path, dtype="float32", device="cuda", kernels="aiter-triton",
              max_num_seqs=4, prefill_graph_tokens=0)
    assert off.engine.runner.prefill_graphs is None
    assert off.engine.runner.graphs is not None  # decode graphs stay on


def test_first_chunk_of_a_longer_prompt_replays_its_graph(checkpoint):
    """A 300-token prompt at 256 tokens a step: the fresh first chunk (no row sampled) from
    the graph, the second over cached context eagerly; transformers' tokens."""
    _aiter_or_skip()
    ckpt = checkpoint("qwen3")
    llm = LLM(ckpt.path, dtype="float32", device="cuda", kernels="aiter-triton",
              max_num_seqs=4, max_num_batched_tokens=256, enable_prefix_caching=False)
    graphs = llm.engine.runner.prefill_graphs
    assert graphs.max_tokens == 256  # capped by the step's token budget
    prompt = random_prompts([300], seed=44)[0]
    assert llm.generate([prompt], GREEDY)[0].token_ids == ckpt.greedy(prompt, 8)
    assert graphs.num_replays == 1


def test_deepseek_v3_mla_prefill_replays_graphs_with_transformers_tokens(tmp_path):
    """MLA's latent cache: a lone fresh prompt prefills from its graph (dense MLPs, so fp32
    greedy parity with transformers is exact)."""
    _aiter_or_skip()
    from test_mla_gpu import DENSE_V3  # its module skips itself without a GPU and amd-aiter
    ckpt = build_checkpoint("deepseek_v3_dense", tmp_path, DENSE_V3, MLA_BASE)
    llm = LLM(ckpt.path, dtype="float32", device="cuda", kernels="aiter-triton",
              max_num_seqs=4, prefill_graph_tokens=256, enable_prefix_caching=False)
    graphs = llm.engine.runner.prefill_graphs
    assert graphs is not None
    for prompt in random_prompts([7, 129, 256], seed=45):
        assert llm.generate([prompt], GREEDY)[0].token_ids == ckpt.greedy(prompt, 8), len(prompt)
    assert graphs.num_replays == 3


def test_next_turn_over_a_cached_prefix_replays_the_paged_graph(checkpoint):
    """bf16: a chat's next turn (its first turn and reply cached) prefills from the graph over
    cached context, and the tokens follow the fp32 reference wherever it is decided; the
    graph's padded queries and zero-padded table leave the real ones and the cache intact."""
    _aiter_or_skip()
    from test_engine_on_gpu import _assert_greedy_where_decided
    ckpt = checkpoint("llama")
    llm = LLM(ckpt.path, dtype="bfloat16", device="cuda", kernels="aiter-triton",
              max_num_seqs=4, prefill_graph_tokens=256)
    graphs = llm.engine.runner.prefill_graphs
    assert graphs.paged
    greedy = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    decided = []
    for seed, (first_len, next_len) in enumerate([(100, 40), (300, 150), (64, 200)]):
        first, more = random_prompts([first_len, next_len], seed=50 + seed)
        reply = llm.generate([first], greedy)[0].token_ids
        before = graphs.num_paged_replays
        turn = first + reply + more
        tokens = llm.generate([turn], greedy)[0].token_ids
        assert graphs.num_paged_replays == before + 1, (first_len, next_len)
        decided.append(_assert_greedy_where_decided(ckpt, turn, tokens))
    assert sum(decided) >= len(decided) * 12, decided
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_a_failed_capture_leaves_prefills_eager(checkpoint, monkeypatch, caplog):
    """An op that cannot be captured costs the speed-up only: the engine starts, says why in
    one warning, and serves every prefill eagerly (decode graphs stay on)."""
    _aiter_or_skip()
    import torch

    from tandem.workers.engine import prefill_graphs

    forward = prefill_graphs.PrefillGraphs._forward

    def refuses_capture(self, bucket, paged):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("operation not permitted when stream is capturing (test)")
        return forward(self, bucket, paged)

    monkeypatch.setattr(prefill_graphs.PrefillGraphs, "_forward", refuses_capture)
    ckpt = checkpoint("qwen3")
    with caplog.at_level("WARNING"):
        llm = LLM(ckpt.path, dtype="float32", device="cuda", kernels="aiter-triton",
                  max_num_seqs=4, prefill_graph_tokens=256)
    assert llm.engine.runner.prefill_graphs is None
    assert llm.engine.runner.graphs is not None
    assert "prefill CUDA graphs not captured" in caplog.text
    prompt = random_prompts([150], seed=60)[0]
    assert llm.generate([prompt], GREEDY)[0].token_ids == ckpt.greedy(prompt, 8)

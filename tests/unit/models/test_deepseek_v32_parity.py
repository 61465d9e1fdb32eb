"""DeepSeek-V3.2 (MLA + the lightning indexer's top-k sparse attention) against transformers on
the same weights (fp32). The tiny model's index_topk (24) is below most prompt + completion
lengths, and each test first shows that attending densely would give other tokens or logits,
so a Tandem that ignored the selection would fail it."""
from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from helpers.checkpoints import (PARITY_LENGTHS, assert_chunked_prefill_parity,
                                 assert_greedy_parity, assert_logits_parity,
                                 random_prompts, relative_error)
from helpers.mla_checkpoints import MLA_VARIANTS

from tandem import LLM
from tandem.workers.engine.model_runner import kv_cache_bytes_per_block, kv_cache_kind
from tandem.common.kv_layout import KVLayout
from tandem.workers.models.deepseek_v32 import DeepseekV32Attention
from tandem.workers.models.glm4_moe import Glm4MoeSparseBlock
from tandem.workers.models.llama import LlamaMLP
from tandem.workers.ops.backend import KernelBackend
from tandem.workers.ops.sparse_mla import SparseMLAAttention

NUM_NEW_TOKENS = 32
CONFIG = MLA_VARIANTS["deepseek_v32"][1]


@pytest.fixture
def ckpt(moe_checkpoint):
    return moe_checkpoint("deepseek_v32")


@contextmanager
def dense(ckpt):
    """transformers' model attending to every earlier token (index_topk above any length)."""
    indexers = [layer.self_attn.indexer for layer in ckpt.model.model.layers]
    try:
        for indexer in indexers:
            indexer.index_topk = 1 << 20
        yield ckpt.model
    finally:
        for indexer in indexers:
            indexer.index_topk = CONFIG["index_topk"]


def test_greedy_tokens_match_transformers(ckpt):
    prompts = random_prompts(PARITY_LENGTHS, seed=1)
    with dense(ckpt) as model, torch.no_grad():
        dense_tokens = [model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW_TOKENS,
                                       min_new_tokens=NUM_NEW_TOKENS, do_sample=False)
                        [0, len(p):].tolist() for p in prompts]
    differ = sum(d != ckpt.greedy(p, NUM_NEW_TOKENS) for p, d in zip(prompts, dense_tokens))
    assert differ >= len(prompts) // 2, "the sparse selection should change most completions"
    llm = LLM(ckpt.path, dtype="float32", enable_prefix_caching=False)
    assert_greedy_parity(llm, ckpt, prompts, NUM_NEW_TOKENS)


def test_logits_at_every_position_match_transformers(ckpt):
    [prompt] = random_prompts([300], seed=2)  # as assert_logits_parity
    tokens = prompt + ckpt.greedy(prompt, NUM_NEW_TOKENS)
    with dense(ckpt):
        dense_logits = ckpt.logits(tokens)
    assert relative_error(dense_logits, ckpt.logits(tokens)) > 1e-2  # >> the 1e-4 tolerance
    assert_logits_parity(ckpt, prompt_len=300, num_new_tokens=NUM_NEW_TOKENS)


def test_chunked_prefill_and_prefix_cache_score_cached_index_keys(ckpt):
    """Chunks select among the index keys of earlier chunks; prefix-cache hits score the prefix
    from the cached index keys (assert_chunked_prefill_parity)."""
    assert_chunked_prefill_parity(ckpt, NUM_NEW_TOKENS)


def test_each_layer_caches_its_latent_and_index_keys(ckpt):
    engine = LLM(ckpt.path, dtype="float32", block_size=16).engine
    layers = engine.model.model.layers
    assert [type(layer.mlp) for layer in layers] == [LlamaMLP, Glm4MoeSparseBlock]
    assert all(isinstance(layer.self_attn.attn, SparseMLAAttention) for layer in layers)
    assert all(layer.self_attn.indexer.weights_proj.weight.dtype == torch.float32
               for layer in layers)
    latent_dim = 32 + 8  # kv_lora_rank + qk_rope_head_dim
    index_dim = CONFIG["index_head_dim"]
    num_blocks = engine.block_manager.num_blocks
    assert [tuple(c.shape for c in caches) for caches in engine.runner.kv_caches] == \
        [((num_blocks, 16, 1, latent_dim), (num_blocks, 16, 1, index_dim))] * 2
    assert kv_cache_bytes_per_block(engine.model, 16, torch.float32) == \
        2 * 16 * (latent_dim + index_dim) * 4
    layout = KVLayout.from_kv_caches(engine.runner.kv_caches, kind=kv_cache_kind(engine.model))
    assert (layout.kind, layout.head_dim, layout.index_head_dim) == \
        ("mla_indexer", latent_dim, index_dim)
    assert layout.bytes_per_layer_block == 16 * (latent_dim + index_dim) * 4


def test_a_config_without_q_lora_rank_is_refused():
    with pytest.raises(ValueError, match="DeepSeek-V3.2 needs q_lora_rank"):
        DeepseekV32Attention(SimpleNamespace(q_lora_rank=None), KernelBackend.TORCH)

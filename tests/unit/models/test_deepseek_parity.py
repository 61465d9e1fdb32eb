"""DeepSeek-V2/V3 (multi-head latent attention + MoE) against transformers on the same weights
(fp32): greedy tokens, logits, chunked prefill over cached latents, and the latent cache."""
from __future__ import annotations

import pytest
import torch
from helpers.checkpoints import (PARITY_LENGTHS, assert_chunked_prefill_parity,
                                 assert_greedy_parity, assert_logits_parity,
                                 random_prompts, rewrite_weights)
from helpers.mla_checkpoints import MLA_BASE, MLA_VARIANTS

from tandem import LLM
from tandem.workers.engine.model_runner import kv_cache_bytes_per_block
from tandem.workers.models.deepseek_v3 import DeepseekV2SparseBlock
from tandem.workers.models.glm4_moe import Glm4MoeSparseBlock
from tandem.workers.models.llama import LlamaMLP

NUM_NEW_TOKENS = 32
# DeepSeek-V3.2 (sparse attention) has its own file: test_deepseek_v32_parity.py.
V2_V3_VARIANTS = [name for name in MLA_VARIANTS if name != "deepseek_v32"]


@pytest.mark.parametrize("variant", V2_V3_VARIANTS)
def test_greedy_tokens_match_transformers(moe_checkpoint, variant):
    ckpt = moe_checkpoint(variant)
    llm = LLM(ckpt.path, dtype="float32", enable_prefix_caching=False)
    assert_greedy_parity(llm, ckpt, random_prompts(PARITY_LENGTHS, seed=1), NUM_NEW_TOKENS)


@pytest.mark.parametrize("variant", V2_V3_VARIANTS)
def test_logits_at_every_position_match_transformers(moe_checkpoint, variant):
    assert_logits_parity(moe_checkpoint(variant), num_new_tokens=NUM_NEW_TOKENS)


@pytest.mark.parametrize("variant", ["deepseek_v3", "deepseek_v3_yarn"])
def test_chunked_prefill_over_cached_latents_matches_transformers(moe_checkpoint, variant):
    """Chunks and prefix-cache hits attend over cached latents (assert_chunked_prefill_parity)."""
    assert_chunked_prefill_parity(moe_checkpoint(variant), NUM_NEW_TOKENS)


def test_layers_follow_first_k_dense_replace_and_the_cache_holds_latents(moe_checkpoint):
    engine = LLM(moe_checkpoint("deepseek_v3").path, dtype="float32", block_size=16).engine
    assert [type(layer.mlp) for layer in engine.model.model.layers] == [
        LlamaMLP, Glm4MoeSparseBlock, Glm4MoeSparseBlock]
    latent_dim = MLA_BASE["kv_lora_rank"] + MLA_BASE["qk_rope_head_dim"]  # 32 + 8
    num_blocks = engine.block_manager.num_blocks
    assert [tuple(c.shape for c in caches) for caches in engine.runner.kv_caches] == \
        [((num_blocks, 16, 1, latent_dim),)] * 3
    assert kv_cache_bytes_per_block(engine.model, 16, torch.float32) == 3 * 16 * latent_dim * 4
    v2 = LLM(moe_checkpoint("deepseek_v2").path, dtype="float32").engine.model.model.layers
    assert [type(layer.mlp) for layer in v2] == [LlamaMLP] + [DeepseekV2SparseBlock] * 2


def test_mtp_layer_tensors_are_skipped(moe_checkpoint, tmp_path):
    """DeepSeek-V3 checkpoints carry num_nextn_predict_layers extra layers after the last."""
    ckpt = moe_checkpoint("deepseek_v3_yarn")

    def add_mtp_layer(tensors):
        tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
        tensors["model.layers.2.self_attn.kv_b_proj.weight"] = torch.zeros(160, 32)

    path = rewrite_weights(ckpt.path, tmp_path / "mtp", add_mtp_layer)
    with_mtp = LLM(path, dtype="float32").engine.model.state_dict()
    without = LLM(ckpt.path, dtype="float32").engine.model.state_dict()
    assert with_mtp.keys() == without.keys()
    assert all(torch.equal(with_mtp[key], without[key]) for key in without)


"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers on the same weights (fp32),
and the loader's handling of their expert tensors."""
from __future__ import annotations


import pytest
import torch
from helpers.checkpoints import (PARITY_LENGTHS, assert_greedy_parity, assert_logits_parity,
                                 random_prompts, rewrite_weights)
from safetensors.torch import load_file

from tandem import LLM
from tandem.workers.models.llama import LlamaMLP
from tandem.workers.models.qwen3_moe import SparseMoeBlock

NUM_NEW_TOKENS = 32
ALL_VARIANTS = ["qwen3_moe", "qwen3_moe_unnormed", "mixtral"]


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_greedy_tokens_match_transformers(moe_checkpoint, variant):
    ckpt = moe_checkpoint(variant)
    llm = LLM(ckpt.path, dtype="float32", enable_prefix_caching=False)
    assert_greedy_parity(llm, ckpt, random_prompts(PARITY_LENGTHS, seed=1))


def test_qwen3_moe_layers_follow_mlp_only_layers(moe_checkpoint):
    layers = LLM(moe_checkpoint("qwen3_moe").path, dtype="float32").engine.model.model.layers
    assert [type(layer.mlp) for layer in layers] == [SparseMoeBlock, LlamaMLP, SparseMoeBlock]
    assert layers[0].mlp.renormalize and layers[0].mlp.experts.w13.shape == (8, 64, 64)


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_logits_at_every_position_match_transformers(moe_checkpoint, variant):
    assert_logits_parity(moe_checkpoint(variant), num_new_tokens=NUM_NEW_TOKENS)


def test_qwen3_moe_parity_with_prefix_caching(moe_checkpoint):
    ckpt = moe_checkpoint("qwen3_moe")
    llm = LLM(ckpt.path, dtype="float32", enable_prefix_caching=True, max_num_batched_tokens=128)
    [shared] = random_prompts([96], seed=4)
    prompts = [shared + tail for tail in random_prompts([1, 20, 50, 100], seed=5)]
    prompts += random_prompts([3, 64, 150, 250], seed=6)
    assert_greedy_parity(llm, ckpt, prompts)
    assert llm.engine.block_manager.prefix_cache_hits > 0


def test_qwen3_moe_parity_with_chunked_prefill(moe_checkpoint):
    ckpt = moe_checkpoint("qwen3_moe")
    llm = LLM(ckpt.path, dtype="float32", max_num_batched_tokens=24, enable_prefix_caching=False)
    assert_greedy_parity(llm, ckpt, random_prompts(PARITY_LENGTHS, seed=7))


def test_qwen3_moe_parity_under_preemption(moe_checkpoint):
    ckpt = moe_checkpoint("qwen3_moe")
    llm = LLM(ckpt.path, dtype="float32", block_size=16, num_kv_blocks=24, max_model_len=384,
              enable_prefix_caching=True)
    assert_greedy_parity(llm, ckpt, random_prompts(PARITY_LENGTHS, seed=8))
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 24


# ---- loading expert tensors ---------------------------------------------------------------

@pytest.mark.parametrize("variant,name,message", [
    ("qwen3_moe", "model.layers.2.mlp.experts.5.up_proj.weight",
     r"missing tensors for: model\.layers\.2\.mlp\.experts\.w13 \(expert 5 'w3'\)"),
    ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w2.weight",
     r"missing tensors for: model\.layers\.1\.mlp\.experts\.w2 \(expert 3 'w2'\)"),
])
def test_missing_expert_tensor_is_named(moe_checkpoint, tmp_path, variant, name, message):
    path = rewrite_weights(moe_checkpoint(variant).path, tmp_path / "ckpt",
                           lambda tensors: tensors.pop(name))
    with pytest.raises(ValueError, match=message):
        LLM(path)


def test_misshaped_or_duplicate_expert_tensor_is_named(moe_checkpoint, tmp_path):
    ckpt = moe_checkpoint("qwen3_moe")
    name = "model.layers.0.mlp.experts.2.gate_proj.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:5].contiguous()

    path = rewrite_weights(ckpt.path, tmp_path / "shrunk", shrink)
    with pytest.raises(ValueError, match=rf"{name}.*expert 2 shard w1: expected shape"):
        LLM(path)

    def add_stacked_copy(tensors):
        tensors["model.layers.0.mlp.experts.down_proj"] = torch.zeros(8, 64, 32)

    path = rewrite_weights(ckpt.path, tmp_path / "twice", add_stacked_copy)
    with pytest.raises(ValueError, match="appears twice"):
        LLM(path)


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_experts_stacked_by_transformers_load_the_same(moe_checkpoint, tmp_path, variant):
    """save_original_format=False writes transformers' in-memory names (experts stacked into
    gate_up_proj / down_proj, Mixtral's block as `mlp`): they load into the same weights."""
    ckpt = moe_checkpoint(variant)
    ckpt.model.save_pretrained(tmp_path, save_original_format=False)
    names = load_file(str(tmp_path / "model.safetensors")).keys()
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    stacked = LLM(tmp_path, dtype="float32").engine.model.state_dict()
    per_expert = LLM(ckpt.path, dtype="float32").engine.model.state_dict()
    assert stacked.keys() == per_expert.keys()
    assert all(torch.equal(stacked[key], per_expert[key]) for key in stacked)

"""GLM-4-MoE against transformers on the same weights (fp32), and loading its checkpoints."""
from __future__ import annotations


import pytest
import torch
from helpers.checkpoints import (PARITY_LENGTHS, assert_greedy_parity, assert_logits_parity,
                                 random_prompts, rewrite_weights)
from helpers.moe_checkpoints import GLM_VARIANTS as VARIANTS
from safetensors.torch import load_file

from tandem import LLM
from tandem.workers.models.glm4_moe import Glm4MoeSparseBlock
from tandem.workers.models.llama import LlamaMLP

NUM_NEW_TOKENS = 32


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_match_transformers(moe_checkpoint, variant):
    ckpt = moe_checkpoint(variant)
    llm = LLM(ckpt.path, dtype="float32", enable_prefix_caching=False)
    assert_greedy_parity(llm, ckpt, random_prompts(PARITY_LENGTHS, seed=1))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_at_every_position_match_transformers(moe_checkpoint, variant):
    assert_logits_parity(moe_checkpoint(variant), num_new_tokens=NUM_NEW_TOKENS)


def test_layers_follow_first_k_dense_replace_and_load_the_bias(moe_checkpoint):
    ckpt = moe_checkpoint("glm4_moe")
    layers = LLM(ckpt.path, dtype="float32").engine.model.model.layers
    assert [type(layer.mlp) for layer in layers] == [LlamaMLP, Glm4MoeSparseBlock,
                                                     Glm4MoeSparseBlock]
    block, reference = layers[2].mlp, ckpt.model.model.layers[2].mlp
    assert block.experts.w13.shape == (8, 64, 64)
    assert block.shared_experts.down_proj.weight.shape == (64, 64)  # 2 shared x 32
    assert layers[1].self_attn.rotary_emb.rotary_dim == 8
    assert torch.count_nonzero(reference.gate.e_score_correction_bias) == 8
    assert torch.equal(block.gate.e_score_correction_bias, reference.gate.e_score_correction_bias)


# ---- loading -------------------------------------------------------------------------------

@pytest.mark.parametrize("name,message", [
    ("model.layers.2.mlp.experts.5.up_proj.weight",
     r"missing tensors for: model\.layers\.2\.mlp\.experts\.w13 \(expert 5 'w3'\)"),
    ("model.layers.1.mlp.gate.e_score_correction_bias",
     r"missing tensors for: model\.layers\.1\.mlp\.gate\.e_score_correction_bias"),
    ("model.layers.1.mlp.shared_experts.up_proj.weight",
     r"missing tensors for: model\.layers\.1\.mlp\.shared_experts\.gate_up_proj\.weight"),
])
def test_missing_tensor_is_named(moe_checkpoint, tmp_path, name, message):
    path = rewrite_weights(moe_checkpoint("glm4_moe").path, tmp_path / "ckpt",
                           lambda tensors: tensors.pop(name))
    with pytest.raises(ValueError, match=message):
        LLM(path)


def test_mtp_layer_tensors_are_skipped(moe_checkpoint, tmp_path):
    """GLM-4.5 checkpoints carry num_nextn_predict_layers extra layers after the last one."""
    ckpt = moe_checkpoint("glm4_moe_plain")

    def add_mtp_layer(tensors):
        tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
        tensors["model.layers.2.mlp.experts.0.gate_proj.weight"] = torch.zeros(48, 64)

    path = rewrite_weights(ckpt.path, tmp_path / "mtp", add_mtp_layer)
    with_mtp = LLM(path, dtype="float32").engine.model.state_dict()
    without = LLM(ckpt.path, dtype="float32").engine.model.state_dict()
    assert with_mtp.keys() == without.keys()
    assert all(torch.equal(with_mtp[key], without[key]) for key in without)


def test_experts_stacked_by_transformers_load_the_same(moe_checkpoint, tmp_path):
    ckpt = moe_checkpoint("glm4_moe_plain")
    ckpt.model.save_pretrained(tmp_path, save_original_format=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(
        str(tmp_path / "model.safetensors")).keys()
    stacked = LLM(tmp_path, dtype="float32").engine.model.state_dict()
    per_expert = LLM(ckpt.path, dtype="float32").engine.model.state_dict()
    assert stacked.keys() == per_expert.keys()
    assert all(torch.equal(stacked[key], per_expert[key]) for key in per_expert)

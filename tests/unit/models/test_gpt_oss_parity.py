"""GPT-OSS against transformers (eager attention, with sinks) on the same weights, in fp32.

The tiny checkpoints use a sliding window smaller than most parity prompts, so windowed and
full layers really differ, and a SwiGLU limit low enough that the clamps are active. Biases and
sinks are randomised before saving (transformers initialises the expert and attention biases
to zero).
"""
from __future__ import annotations


import pytest
import torch
from helpers.checkpoints import (PARITY_LENGTHS, assert_greedy_parity, assert_logits_parity,
                                 random_prompts, rewrite_weights)
from helpers.moe_checkpoints import GPT_OSS_VARIANTS as VARIANTS

from tandem import LLM
from tandem.workers.models.gpt_oss import GptOssExperts

NUM_NEW_TOKENS = 32


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_match_transformers(moe_checkpoint, variant):
    ckpt = moe_checkpoint(variant)
    llm = LLM(ckpt.path, dtype="float32", enable_prefix_caching=False)
    assert_greedy_parity(llm, ckpt, random_prompts(PARITY_LENGTHS, seed=1))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_at_every_position_match_transformers(moe_checkpoint, variant):
    assert_logits_parity(moe_checkpoint(variant), num_new_tokens=NUM_NEW_TOKENS)


def test_parity_with_chunked_prefill(moe_checkpoint):
    """Chunks of 12 tokens, smaller than the 16-key window: a chunk's queries see keys of the
    chunks before it, and the oldest of those fall out of the window."""
    ckpt = moe_checkpoint("gpt_oss")
    llm = LLM(ckpt.path, dtype="float32", max_num_batched_tokens=12, enable_prefix_caching=False)
    assert_greedy_parity(llm, ckpt, random_prompts(PARITY_LENGTHS, seed=1))


def test_layers_follow_layer_types_and_clamps_are_active(moe_checkpoint):
    ckpt = moe_checkpoint("gpt_oss_default_rope")
    layers = LLM(ckpt.path, dtype="float32").engine.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [None, 32, 32]
    hf_layer = ckpt.model.model.layers[0]
    assert torch.equal(layers[0].self_attn.attn.sinks, hf_layer.self_attn.sinks)
    experts = layers[0].mlp.experts
    assert isinstance(experts, GptOssExperts) and experts.w13.shape == (4, 64, 64)
    # The transformers gate/up pre-activations of random tokens exceed the limit somewhere,
    # so the parity tests exercise the clamps.
    hidden = hf_layer.post_attention_layernorm(torch.randn(64, 64))
    hf_experts = hf_layer.mlp.experts
    gate_up = hidden @ hf_experts.gate_up_proj[0] + hf_experts.gate_up_proj_bias[0]
    assert (gate_up.detach().abs() > ckpt.model.config.swiglu_limit).any()


# ---- loading -------------------------------------------------------------------------------

@pytest.mark.parametrize("name,message", [
    ("model.layers.1.self_attn.sinks", r"missing tensors for: model\.layers\.1\.self_attn\.attn\."
                                       r"sinks"),
    ("model.layers.0.mlp.experts.gate_up_proj",
     r"missing tensors for: model\.layers\.0\.mlp\.experts\.w13 \(expert 0 'w1', expert 0 'w3'"),
    ("model.layers.1.mlp.experts.down_proj_bias",
     r"missing tensors for: model\.layers\.1\.mlp\.experts\.w2_bias \(expert 0 'w2'"),
    ("model.layers.0.mlp.router.bias", r"missing tensors for: model\.layers\.0\.mlp\.router\.bias"),
    ("model.layers.0.self_attn.q_proj.bias",
     r"missing tensors for: model\.layers\.0\.self_attn\.qkv_proj\.bias"),
])
def test_missing_tensor_is_named(moe_checkpoint, tmp_path, name, message):
    path = rewrite_weights(moe_checkpoint("gpt_oss").path, tmp_path / "ckpt",
                           lambda tensors: tensors.pop(name))
    with pytest.raises(ValueError, match=message):
        LLM(path)


def test_misshaped_or_quantized_expert_tensor_is_named(moe_checkpoint, tmp_path):
    ckpt = moe_checkpoint("gpt_oss")
    name = "model.layers.0.mlp.experts.gate_up_proj"

    def transpose(tensors):  # [E, H, 2I] -> [E, 2I, H]: our layout, not the checkpoint's
        tensors[name] = tensors[name][:, :, :48].transpose(1, 2).contiguous()

    path = rewrite_weights(ckpt.path, tmp_path / "misshaped", transpose)
    with pytest.raises(ValueError, match=rf"{name}.*expected GPT-OSS stacked expert shape "
                                         r"\(4, 64, 64\), checkpoint has \(4, 48, 64\)"):
        LLM(path)

    def quantize(tensors):
        tensors[name + "_blocks"] = tensors.pop(name).to(torch.uint8)

    path = rewrite_weights(ckpt.path, tmp_path / "mxfp4", quantize)
    with pytest.raises(ValueError, match=rf"{name}_blocks.*MXFP4"):
        LLM(path)

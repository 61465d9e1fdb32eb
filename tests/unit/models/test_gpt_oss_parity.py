"""GPT-OSS against transformers (eager attention, with sinks) on the same weights, in fp32.

The tiny checkpoints use a sliding window smaller than most parity prompts, so windowed and
full layers really differ, and a SwiGLU limit low enough that the clamps are active. Biases and
sinks are randomised before saving (transformers initialises the expert and attention biases
to zero).
"""
from __future__ import annotations

import shutil

import pytest
import torch
from helpers.checkpoints import (MAX_POS, PARITY_LENGTHS, VOCAB, build_checkpoint,
                                 paged_prefill_logits, random_prompts, relative_error)
from safetensors.torch import load_file, save_file

from tandem import LLM, SamplingParams
from tandem.workers.models.gpt_oss import GptOssExperts

NUM_NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, head_dim=16,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=MAX_POS, initializer_range=0.1,
            eos_token_id=VOCAB - 1, bos_token_id=0, swiglu_limit=1.0)

# name -> (architecture, config overrides, save_pretrained kwargs)
VARIANTS = {
    # transformers' defaults: YaRN rope (truncate False), layers alternate sliding / full.
    "gpt_oss": ("gpt_oss", {"num_hidden_layers": 2, "sliding_window": 16}, {}),
    # Plain rope, and a layer pattern that is not the alternating default.
    "gpt_oss_default_rope": ("gpt_oss", {
        "num_hidden_layers": 3, "sliding_window": 32, "num_experts_per_tok": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}, {}),
}


@pytest.fixture(scope="module")
def gpt_oss_checkpoint(tmp_path_factory):
    """gpt_oss_checkpoint(name) -> TinyCheckpoint with random biases and sinks."""
    built = {}

    def get(name: str):
        if name not in built:
            ckpt = build_checkpoint(name, tmp_path_factory.mktemp(name), VARIANTS, BASE)
            gen = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for param_name, param in ckpt.model.named_parameters():
                    if param_name.endswith("sinks"):  # large enough to take real mass
                        param.copy_(torch.randn(param.shape, generator=gen) + 1.0)
                    elif param_name.endswith("bias"):
                        param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
            assert ckpt.model.config._attn_implementation == "eager"  # the one with sinks
            ckpt.model.save_pretrained(ckpt.path, **VARIANTS[name][2])
            built[name] = ckpt
        return built[name]

    return get


def assert_greedy_parity(llm: LLM, ckpt, prompts: list[list[int]]) -> None:
    outputs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == ckpt.greedy(prompt, NUM_NEW_TOKENS), \
            f"prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == "length"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_match_transformers(gpt_oss_checkpoint, variant):
    ckpt = gpt_oss_checkpoint(variant)
    llm = LLM(ckpt.path, dtype="float32", enable_prefix_caching=False)
    assert_greedy_parity(llm, ckpt, random_prompts(PARITY_LENGTHS, seed=1))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_at_every_position_match_transformers(gpt_oss_checkpoint, variant):
    ckpt = gpt_oss_checkpoint(variant)
    engine = LLM(ckpt.path, dtype="float32", block_size=16).engine
    [prompt] = random_prompts([300], seed=2)
    tokens = prompt + ckpt.greedy(prompt, NUM_NEW_TOKENS)
    assert relative_error(paged_prefill_logits(engine, tokens), ckpt.logits(tokens)) < 1e-4


def test_parity_with_chunked_prefill(gpt_oss_checkpoint):
    """Chunks of 12 tokens, smaller than the 16-key window: a chunk's queries see keys of the
    chunks before it, and the oldest of those fall out of the window."""
    ckpt = gpt_oss_checkpoint("gpt_oss")
    llm = LLM(ckpt.path, dtype="float32", max_num_batched_tokens=12, enable_prefix_caching=False)
    assert_greedy_parity(llm, ckpt, random_prompts(PARITY_LENGTHS, seed=1))


def test_layers_follow_layer_types_and_clamps_are_active(gpt_oss_checkpoint):
    ckpt = gpt_oss_checkpoint("gpt_oss_default_rope")
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

def rewrite_weights(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


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
def test_missing_tensor_is_named(gpt_oss_checkpoint, tmp_path, name, message):
    path = rewrite_weights(gpt_oss_checkpoint("gpt_oss").path, tmp_path / "ckpt",
                           lambda tensors: tensors.pop(name))
    with pytest.raises(ValueError, match=message):
        LLM(path)


def test_misshaped_or_quantized_expert_tensor_is_named(gpt_oss_checkpoint, tmp_path):
    ckpt = gpt_oss_checkpoint("gpt_oss")
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

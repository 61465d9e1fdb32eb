"""Tiny mixture-of-experts transformers models saved as real checkpoints (see checkpoints.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from helpers.checkpoints import MAX_POS, VOCAB, TinyCheckpoint, build_checkpoint

_BASE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=MAX_POS, initializer_range=0.1, eos_token_id=VOCAB - 1,
             bos_token_id=0, num_experts_per_tok=2)

# name -> (architecture, config overrides, save_pretrained kwargs)
MOE_VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # Layer 1 is dense (mlp_only_layers); 8 experts, top-2, renormalised.
    "qwen3_moe": ("qwen3_moe", {"num_hidden_layers": 3, "num_experts": 8, "intermediate_size": 64,
                                "moe_intermediate_size": 32, "mlp_only_layers": [1],
                                "norm_topk_prob": True}, {}),
    # Every layer sparse, top-2 weights not renormalised.
    "qwen3_moe_unnormed": ("qwen3_moe", {"num_hidden_layers": 2, "num_experts": 4,
                                         "intermediate_size": 64, "moe_intermediate_size": 48,
                                         "norm_topk_prob": False, "head_dim": 32}, {}),
    "mixtral": ("mixtral", {"num_hidden_layers": 2, "num_local_experts": 4,
                            "intermediate_size": 64}, {}),
}


def build_moe_checkpoint(name: str, directory: Path) -> TinyCheckpoint:
    """Any tiny MoE variant by name: MOE_VARIANTS, GLM_VARIANTS, GPT_OSS_VARIANTS or
    MLA_VARIANTS (DeepSeek, in mla_checkpoints.py)."""
    from helpers.mla_checkpoints import MLA_VARIANTS, build_mla_checkpoint

    if name in MLA_VARIANTS:
        return build_mla_checkpoint(name, directory)
    if name in GLM_VARIANTS:
        return build_glm_checkpoint(name, directory)
    if name in GPT_OSS_VARIANTS:
        return build_gpt_oss_checkpoint(name, directory)
    return build_checkpoint(name, directory, MOE_VARIANTS, _BASE)


GLM_BASE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=MAX_POS, initializer_range=0.1, eos_token_id=VOCAB - 1,
            bos_token_id=0, num_experts_per_tok=2, intermediate_size=64)

# name -> (architecture, config overrides, save_pretrained kwargs)
GLM_VARIANTS = {
    # Layer 0 dense; 8 experts in 4 groups of which the best 2 are eligible; 2 shared experts;
    # renormalised weights scaled by 2.5; QK norm; RoPE on half of each 16-dim head (default).
    "glm4_moe": ("glm4_moe", {"num_hidden_layers": 3, "first_k_dense_replace": 1,
                              "n_routed_experts": 8, "moe_intermediate_size": 32,
                              "n_shared_experts": 2, "n_group": 4, "topk_group": 2,
                              "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                              "use_qk_norm": True}, {}),
    # Every layer sparse, one group, no QK norm, weights not renormalised, q/k/v biases.
    "glm4_moe_plain": ("glm4_moe", {"num_hidden_layers": 2, "first_k_dense_replace": 0,
                                    "n_routed_experts": 4, "moe_intermediate_size": 48,
                                    "n_shared_experts": 1, "norm_topk_prob": False,
                                    "use_qk_norm": False, "attention_bias": True,
                                    "partial_rotary_factor": 0.75}, {}),
}


def build_glm_checkpoint(name: str, directory: Path) -> TinyCheckpoint:
    """A tiny GLM-4-MoE whose routers have a random, non-zero correction bias (transformers
    initialises it to zeros, which would leave the bias path untested)."""
    ckpt = build_checkpoint(name, directory, GLM_VARIANTS, GLM_BASE)
    generator = torch.Generator().manual_seed(3)
    for layer in ckpt.model.model.layers:
        if hasattr(layer.mlp, "gate"):
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(torch.rand(bias.shape, generator=generator) * 0.4 - 0.2)
    ckpt.model.save_pretrained(ckpt.path)
    return ckpt


GPT_OSS_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, head_dim=16,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, max_position_embeddings=MAX_POS,
                    initializer_range=0.1, eos_token_id=VOCAB - 1, bos_token_id=0,
                    swiglu_limit=1.0)

# name -> (architecture, config overrides, save_pretrained kwargs)
GPT_OSS_VARIANTS = {
    # transformers' defaults: YaRN rope (truncate False), layers alternate sliding / full.
    "gpt_oss": ("gpt_oss", {"num_hidden_layers": 2, "sliding_window": 16}, {}),
    # Plain rope, and a layer pattern that is not the alternating default.
    "gpt_oss_default_rope": ("gpt_oss", {
        "num_hidden_layers": 3, "sliding_window": 32, "num_experts_per_tok": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}, {}),
}


def build_gpt_oss_checkpoint(name: str, directory: Path) -> TinyCheckpoint:
    """A tiny GPT-OSS with random biases and sinks (transformers initialises them to zero)."""
    ckpt = build_checkpoint(name, directory, GPT_OSS_VARIANTS, GPT_OSS_BASE)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param_name, param in ckpt.model.named_parameters():
            if param_name.endswith("sinks"):  # large enough to take real mass
                param.copy_(torch.randn(param.shape, generator=gen) + 1.0)
            elif param_name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    assert ckpt.model.config._attn_implementation == "eager"  # the one with sinks
    ckpt.model.save_pretrained(ckpt.path, **GPT_OSS_VARIANTS[name][2])
    return ckpt

"""Tiny DeepSeek-V2/V3/V3.2 models (multi-head latent attention + MoE) saved as real checkpoints."""
from __future__ import annotations

from pathlib import Path

import torch

from helpers.checkpoints import MAX_POS, VOCAB, TinyCheckpoint, build_checkpoint

# transformers' DeepSeek attention needs num_key_value_heads == num_attention_heads.
MLA_BASE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                intermediate_size=64, moe_intermediate_size=32, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, num_experts_per_tok=2,
                max_position_embeddings=MAX_POS, initializer_range=0.1, eos_token_id=VOCAB - 1,
                bos_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

# YaRN with a short original context, and mscale != mscale_all_dim so both corrections count:
# cos/sin times mscale(4, 1.0) / mscale(4, 0.5), the softmax scale times mscale(4, 0.5)^2.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.5}

# name -> (architecture, config overrides, save_pretrained kwargs)
MLA_VARIANTS = {
    # DeepSeek-V3 shape: LoRA-compressed q, interleaved RoPE; layer 0 dense, then 8 experts in
    # 4 groups (best 2 eligible), sigmoid + correction bias, renormalised, times 2.5.
    "deepseek_v3": ("deepseek_v3", {"num_hidden_layers": 3, "first_k_dense_replace": 1,
                                    "q_lora_rank": 24, "n_routed_experts": 8, "n_group": 4,
                                    "topk_group": 2, "n_shared_experts": 1,
                                    "routed_scaling_factor": 2.5, "norm_topk_prob": True}, {}),
    # YaRN, plain q_proj (q_lora_rank None), NeoX RoPE, attention biases, one expert group.
    "deepseek_v3_yarn": ("deepseek_v3", {"num_hidden_layers": 2, "first_k_dense_replace": 1,
                                         "q_lora_rank": None, "rope_parameters": YARN,
                                         "rope_interleave": False, "attention_bias": True,
                                         "n_routed_experts": 4, "n_group": 1, "topk_group": 1,
                                         "n_shared_experts": 2, "routed_scaling_factor": 1.5,
                                         "norm_topk_prob": False}, {}),
    # DeepSeek-V2-Lite shape: plain q_proj, softmax top-3 limited to the best 2 of 4 groups
    # (with top-2 that limit would never bind: the best two experts' groups are the best two).
    "deepseek_v2": ("deepseek_v2", {"num_hidden_layers": 3, "first_k_dense_replace": 1,
                                    "q_lora_rank": None, "n_routed_experts": 12,
                                    "num_experts_per_tok": 3,
                                    "topk_method": "group_limited_greedy", "n_group": 4,
                                    "topk_group": 2, "n_shared_experts": 2,
                                    "routed_scaling_factor": 2.0, "norm_topk_prob": False}, {}),
    # DeepSeek-V3.2: V3 plus the lightning indexer. index_topk 24 is below most prompt +
    # completion lengths of the parity tests, so most queries attend to a sparse selection;
    # 8 index heads of 32 dims (RoPE on the first 8) make exact score ties (every head's
    # relu at 0) rare. YaRN so the indexer's NeoX RoPE carries the attention factor too.
    "deepseek_v32": ("deepseek_v32", {"num_hidden_layers": 2, "first_k_dense_replace": 1,
                                      "q_lora_rank": 24, "rope_parameters": YARN,
                                      "n_routed_experts": 8, "n_group": 4, "topk_group": 2,
                                      "n_shared_experts": 1, "routed_scaling_factor": 2.5,
                                      "norm_topk_prob": True, "index_topk": 24,
                                      "index_head_dim": 32, "index_n_heads": 8}, {}),
}


def build_mla_checkpoint(name: str, directory: Path) -> TinyCheckpoint:
    """A tiny DeepSeek whose V3 routers have a random, non-zero correction bias, and whose
    V3.2 indexer key norms a random weight and bias (transformers initialises them to zeros
    and ones, which would leave those paths untested)."""
    ckpt = build_checkpoint(name, directory, MLA_VARIANTS, MLA_BASE)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in ckpt.model.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.rand(bias.shape, generator=generator) * 0.4 - 0.2)
            indexer = getattr(layer.self_attn, "indexer", None)
            if indexer is not None:
                norm = indexer.k_norm
                norm.weight.copy_(1 + torch.randn(norm.weight.shape, generator=generator) * 0.2)
                norm.bias.copy_(torch.randn(norm.bias.shape, generator=generator) * 0.2)
    ckpt.model.save_pretrained(ckpt.path)
    return ckpt

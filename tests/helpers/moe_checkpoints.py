"""Tiny mixture-of-experts transformers models saved as real checkpoints (see checkpoints.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

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
    return build_checkpoint(name, directory, MOE_VARIANTS, _BASE)

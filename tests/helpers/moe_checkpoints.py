"""Tiny mixture-of-experts transformers models saved as real checkpoints (see checkpoints.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.checkpoints import MAX_POS, VOCAB, TinyCheckpoint, save_tiny_tokenizer

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
    import transformers

    arch, overrides, save_kwargs = MOE_VARIANTS[name]
    config_cls, model_cls = {
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }[arch]
    torch.manual_seed(sum(map(ord, name)))
    config = config_cls(**{**_BASE, **overrides})
    model = model_cls(config).eval()
    model.save_pretrained(directory, **save_kwargs)
    save_tiny_tokenizer(Path(directory))
    return TinyCheckpoint(name, Path(directory), model)


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory):
    """moe_checkpoint(name) -> TinyCheckpoint, built once per session per variant name."""
    built = {}

    def get(name: str) -> TinyCheckpoint:
        if name not in built:
            built[name] = build_moe_checkpoint(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get

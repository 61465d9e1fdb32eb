"""Full-size model shapes for bench/engine.py, as config.json folders with random weights.

Only the config is written: the engine builds the model on the GPU with load_format="dummy", so
no checkpoint is downloaded or stored. Shapes follow the published configs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def _llama3_8b() -> Any:
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        architectures=["LlamaForCausalLM"], dtype="bfloat16")


def _qwen3_30b_a3b() -> Any:
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
        architectures=["Qwen3MoeForCausalLM"], dtype="bfloat16")


MODELS = {"llama3-8b": _llama3_8b, "qwen3-30b-a3b": _qwen3_30b_a3b}


def write_model_dir(name: str, root: Path) -> Path:
    if name not in MODELS:
        raise ValueError(f"unknown bench model {name!r}; choose from {', '.join(MODELS)}")
    path = root / name
    MODELS[name]().save_pretrained(path)
    return path


def weight_bytes(model_dir: Path, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of the model's parameters, from a build on the meta device (allocates nothing)."""
    from tandem.workers.models.loader import load_hf_config
    from tandem.workers.models.registry import resolve_model_class
    from tandem.workers.ops.backend import KernelBackend

    config = load_hf_config(model_dir)
    with torch.device("meta"):
        model = resolve_model_class(config)(config, KernelBackend.TORCH)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in model.parameters()) * itemsize

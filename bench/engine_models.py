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


def _deepseek_v3_slice() -> Any:
    """DeepSeek-V3's published config at full width, cut to 4 layers (1 dense, 3 MoE): MLA with
    128 heads, 256 routed experts + 1 shared, top-8 in 8 groups, YaRN. bf16 weights ~74 GB
    (each MoE layer 22.5 GB): it fits an H200; an 80 GB H100 runs it with
    --gpu-memory-utilization 0.95 (an 8k prefill's activations ~3 GiB, the latent KV cache
    the 1.3 GiB left)."""
    from transformers import DeepseekV3Config
    return DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=128,
        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
        norm_topk_prob=True, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        rope_interleave=True, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
        architectures=["DeepseekV3ForCausalLM"], dtype="bfloat16")


MODELS = {"llama3-8b": _llama3_8b, "qwen3-30b-a3b": _qwen3_30b_a3b,
          "deepseek-v3-slice": _deepseek_v3_slice}


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

"""bench/engine.py's floor inputs (shape_of) for the full-size bench models, built on the meta
device (no memory): KV bytes per token and layer for MHA/GQA and for MLA's latent cache."""
from __future__ import annotations

import pytest
import torch

from tandem.bench.engine_limits import shape_of
from tandem.bench.engine_models import write_model_dir
from tandem.workers.models.loader import load_hf_config
from tandem.workers.models.registry import resolve_model_class
from tandem.workers.ops.backend import KernelBackend


@pytest.mark.parametrize("name, kv_heads, head_dim, kv_bytes, moe_layers", [
    ("llama3-8b", 8, 128, 2 * 8 * 128 * 2, 0),
    # MLA: one latent row of kv_lora_rank 512 + rope 64 in bf16; head_dim (192 + 128) / 2
    ("deepseek-v3-slice", 1, 160, (512 + 64) * 2, 3),
])
def test_shape_of_counts_the_cache_each_attention_keeps(tmp_path, name, kv_heads, head_dim,
                                                        kv_bytes, moe_layers):
    config = load_hf_config(write_model_dir(name, tmp_path))
    with torch.device("meta"):
        model = resolve_model_class(config)(config, KernelBackend.TORCH).to(torch.bfloat16)
    shape = shape_of(model, config, getattr(config, "num_experts_per_tok", 0))
    assert (shape.num_kv_heads, shape.head_dim) == (kv_heads, head_dim)
    assert shape.kv_bytes_per_token_layer == kv_bytes
    assert shape.num_moe_layers == moe_layers
    assert shape.num_layers == (4 if moe_layers else 32)

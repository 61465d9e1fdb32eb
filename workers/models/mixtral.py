"""Mixtral: Llama's attention with a sparse mixture-of-experts MLP in every layer.

Routing is softmax top-k, always renormalised. Checkpoints name the block `block_sparse_moe`
(`block_sparse_moe.gate.weight`, `block_sparse_moe.experts.{e}.w1|w2|w3.weight`, which is
also what transformers 5.x `save_pretrained` writes); transformers' in-memory names (`mlp.`,
and stacked `mlp.experts.gate_up_proj` / `down_proj` with `save_original_format=False`) load
too. The block is module `mlp` here so Llama's layer forward runs it unchanged.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from tandem.workers.models.llama import LlamaAttention
from tandem.workers.models.qwen3_moe import (Qwen3MoeDecoderLayer, Qwen3MoeForCausalLM,
                                             Qwen3MoeModel, SparseMoeBlock, map_expert_name)
from tandem.workers.ops.backend import KernelBackend
from tandem.workers.ops.moe import DOWN, GATE, UP


class MixtralAttention(LlamaAttention):
    def __init__(self, config: Any, backend: KernelBackend) -> None:
        if getattr(config, "sliding_window", None) is not None:
            raise ValueError(f"Mixtral with sliding_window={config.sliding_window} is not "
                             f"supported yet")
        super().__init__(config, backend)


class MixtralDecoderLayer(Qwen3MoeDecoderLayer):
    attention_cls = MixtralAttention

    def build_mlp(self, config: Any, backend: KernelBackend, layer_idx: int) -> nn.Module:
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        return SparseMoeBlock(config.hidden_size, config.num_local_experts,
                              config.num_experts_per_tok, config.intermediate_size,
                              renormalize=True, backend=backend)


class MixtralModel(Qwen3MoeModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(Qwen3MoeForCausalLM):
    model_cls = MixtralModel
    expert_shards = {"w1": GATE, "w3": UP, "w2": DOWN}

    def map_checkpoint_name(self, name: str) -> list[tuple[str, Any, int | None]] | None:
        """Loader hook: `block_sparse_moe.` -> `mlp.`, and expert tensors -> (param, shard id,
        expert id); None (the generic mapping) for attention and norms."""
        if ".block_sparse_moe." not in name:
            return map_expert_name(name, self.expert_shards, self.config.num_local_experts)
        name = name.replace(".block_sparse_moe.", ".mlp.")
        targets = map_expert_name(name, self.expert_shards, self.config.num_local_experts)
        return targets if targets is not None else [(name, None, None)]

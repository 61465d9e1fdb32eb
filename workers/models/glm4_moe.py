"""GLM-4-MoE (GLM-4.5 / 4.6 / 4.7): Llama's layer with partial RoPE, optional QK norm, and a
sigmoid-routed mixture of experts plus always-on shared experts.

Per layer, as transformers' `Glm4MoeDecoderLayer`:
  * attention: q/k/v bias when `attention_bias` (o_proj never has one); RMSNorm per q and k head
    when `use_qk_norm`; NeoX RoPE over the first int(head_dim * partial_rotary_factor) dims.
  * MLP: layers [0, first_k_dense_replace) are dense (`intermediate_size`); the others are
    `Glm4MoeSparseBlock`: routed experts (sigmoid router + `e_score_correction_bias` for choosing,
    grouped top-k, optional renorm, times `routed_scaling_factor`) plus a shared SiLU MLP of
    moe_intermediate_size * n_shared_experts added to their output.

Checkpoint names are transformers' (`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`,
`mlp.shared_experts.*`, per-expert `mlp.experts.{e}.gate_proj.weight` or stacked
`mlp.experts.gate_up_proj`). Layers at index >= num_hidden_layers are the multi-token-prediction
(MTP) heads that GLM-4.5 checkpoints ship; they are skipped, as transformers does.
"""
from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.workers.models.llama import LlamaAttention, LlamaMLP
from tandem.workers.models.qwen3_moe import (Qwen3MoeDecoderLayer, Qwen3MoeForCausalLM,
                                             Qwen3MoeModel, map_expert_name)
from tandem.workers.ops.backend import KernelBackend
from tandem.workers.ops.linear import RowParallelLinear
from tandem.workers.ops.moe import DOWN, GATE, UP, FusedMoE
from tandem.workers.ops.norm import RMSNorm

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class Glm4MoeAttention(LlamaAttention):
    def __init__(self, config: Any, backend: KernelBackend) -> None:
        super().__init__(config, backend)
        # attention_bias covers q/k/v only (Llama's layer would give o_proj one too).
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias=False)
        self.use_qk_norm = bool(getattr(config, "use_qk_norm", False))
        if self.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend)

    @property
    def qk_norm(self) -> tuple[nn.Module, nn.Module] | None:
        return (self.q_norm, self.k_norm) if self.use_qk_norm else None  # per head


class Glm4MoeRouter(nn.Module):
    """`gate`: logits [T, E] in fp32 (as transformers) and the fp32 correction bias [E], which
    only steers the choice of experts. The weight is kept in fp32 (the checkpoint's values
    exactly), so a step reads it once instead of converting it first."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(num_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E] fp32
        return F.linear(hidden.float(), self.weight)


class Glm4MoeSparseBlock(nn.Module):
    """Routed experts (sigmoid, grouped top-k) plus the shared experts, summed."""

    def __init__(self, config: Any, backend: KernelBackend) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.renormalize = bool(config.norm_topk_prob)
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        self.gate = Glm4MoeRouter(config.hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, config.hidden_size, config.moe_intermediate_size,
                                backend=backend)
        shared_size = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = LlamaMLP(SimpleNamespace(
            hidden_size=config.hidden_size, intermediate_size=shared_size), backend)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        topk_weights, topk_ids = self.experts.select(
            self.gate(hidden), self.top_k, scoring="sigmoid", renormalize=self.renormalize,
            e_score_correction_bias=self.gate.e_score_correction_bias, n_group=self.n_group,
            topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor)
        routed = self.experts(hidden, topk_weights, topk_ids)
        return routed + self.shared_experts(hidden)


class Glm4MoeDecoderLayer(Qwen3MoeDecoderLayer):
    attention_cls = Glm4MoeAttention

    def build_mlp(self, config: Any, backend: KernelBackend, layer_idx: int) -> nn.Module:
        if layer_idx < config.first_k_dense_replace:
            return LlamaMLP(config, backend)
        return Glm4MoeSparseBlock(config, backend)


class Glm4MoeModel(Qwen3MoeModel):
    layer_cls = Glm4MoeDecoderLayer


class Glm4MoeForCausalLM(Qwen3MoeForCausalLM):
    model_cls = Glm4MoeModel
    expert_shards = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}

    def map_checkpoint_name(self, name: str) -> list[tuple[str, Any, int | None]] | None:
        """Loader hook: MTP layers -> [] (skipped); expert tensors -> (param, shard id, expert
        id); None (the generic mapping) for the rest."""
        match = _LAYER_INDEX.match(name)
        if match and int(match[1]) >= self.config.num_hidden_layers:
            return []
        return map_expert_name(name, self.expert_shards, self.config.n_routed_experts)

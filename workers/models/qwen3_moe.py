"""Qwen3-MoE: Qwen3's attention (QK-norm) with a sparse mixture-of-experts MLP.

A layer is sparse when it is not in `mlp_only_layers` and (index + 1) is a multiple of
`decoder_sparse_step`; the other layers keep Qwen3's dense MLP (`intermediate_size`).
The sparse block is the router `gate` [E, H] plus the experts stacked in one FusedMoE
(`experts.w13`, `experts.w2`); `map_checkpoint_name` tells the loader where each checkpoint
expert tensor goes. transformers (5.x) saves one tensor per expert and projection
(`mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`) by default, and tensors stacked
over experts (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) with
`save_original_format=False`; both load.
"""
from __future__ import annotations

import functools
import re
from typing import Any

import torch
from torch import nn

from tandem.workers.models.llama import LlamaMLP
from tandem.workers.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model
from tandem.workers.ops import small_batch
from tandem.workers.ops.backend import KernelBackend
from tandem.workers.ops.embedding import VocabParallelEmbedding
from tandem.workers.ops.linear import ReplicatedLinear
from tandem.workers.ops.moe import DOWN, GATE, STACKED_GATE_UP, UP, FusedMoE, expert_targets
from tandem.workers.ops.norm import RMSNorm

# "<prefix>.experts.<e>.<proj>.<weight|bias>" and "<prefix>.experts.<stacked>[_bias]"
_PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)"
                         r"\.(?P<kind>weight|bias)$")
_STACKED = re.compile(r"^(?P<experts>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)"
                      r"(?P<bias>_bias)?$")
_STACKED_SHARDS = {"gate_up_proj": STACKED_GATE_UP, "down_proj": DOWN}


def map_expert_name(name: str, per_expert_shards: dict[str, str], num_experts: int
                    ) -> list[tuple[str, str, int]] | None:
    """A checkpoint expert tensor's targets (see `expert_targets`), or None for other names.

    per_expert_shards: the checkpoint's projection names -> shard ids ("gate_proj" -> "w1").
    """
    match = _PER_EXPERT.match(name)
    if match and match["proj"] in per_expert_shards:
        return expert_targets(match["experts"], per_expert_shards[match["proj"]],
                              int(match["expert"]), num_experts, match["kind"] == "bias")
    match = _STACKED.match(name)
    if match:
        return expert_targets(match["experts"], _STACKED_SHARDS[match["proj"]], None,
                              num_experts, match["bias"] is not None)
    return None


class SparseMoeBlock(nn.Module):
    """Router (`gate`: hidden -> one logit per expert), softmax top-k, then the experts."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, backend: KernelBackend) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, backend=backend)

    def forward(self, hidden: torch.Tensor, summed: bool = True) -> torch.Tensor:
        """hidden [T, H] -> [T, H]; summed=False may return the experts' weighted outputs
        unsummed, [T, k, H] (FusedMoE.forward), which RMSNorm with a residual adds up."""
        return self.route(hidden, self.gate(hidden), summed)

    def route(self, hidden: torch.Tensor, router_logits: torch.Tensor,
              summed: bool = True) -> torch.Tensor:
        """The experts on hidden [T, H] given the router's logits [T, E] -> [T, H] (or
        terms, as forward)."""
        return self.experts.forward_logits(hidden, router_logits, top_k=self.top_k,
                                           renormalize=self.renormalize, summed=summed)


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """transformers' rule for which Qwen3-MoE layers get experts."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % step == 0)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """Qwen3's layer (and its forward) with the MLP chosen per layer index."""

    def __init__(self, config: Any, backend: KernelBackend, layer_idx: int) -> None:
        # Not Llama's __init__: it always builds a dense MLP, which a sparse layer never uses.
        nn.Module.__init__(self)
        self.self_attn = self.attention_cls(config, backend)
        self.mlp = self.build_mlp(config, backend, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)

    @functools.cached_property
    def _router_fusable(self) -> bool:
        """Whether a small batch's post-attention add + norm and the router run as one fused
        GEMV that also keeps the normed rows for the experts (small_batch.norm_router)."""
        mlp = self.mlp
        return isinstance(mlp, SparseMoeBlock) and small_batch.fusable(
            (self.post_attention_layernorm,), (mlp.gate,))

    def mlp_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """A sparse layer's experts leave their outputs unsummed where the kernels allow: the
        layer's output goes only to the next RMSNorm with a residual (the next layer's input
        norm or the model's final norm), which adds the terms in the same pass."""
        if isinstance(self.mlp, SparseMoeBlock):
            return self.mlp(hidden, summed=False)
        return self.mlp(hidden)

    def _mlp_small_batch(self, hidden: torch.Tensor, residual: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._router_fusable:
            return super()._mlp_small_batch(hidden, residual)
        logits, residual, normed = small_batch.norm_router(
            hidden, residual, self.post_attention_layernorm, self.mlp.gate)
        # Unsummed: the next layer's fused add + norm + qkv (or the final norm) takes the
        # experts' fp32 sum, so no sum-over-k launch runs.
        return self.mlp.route(normed, logits, summed=False), residual

    def build_mlp(self, config: Any, backend: KernelBackend, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config, backend)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, bool(config.norm_topk_prob), backend)


class Qwen3MoeModel(Qwen3Model):
    """Qwen3's model (and its forward); layers are built knowing their index."""

    layer_cls = Qwen3MoeDecoderLayer

    def __init__(self, config: Any, backend: KernelBackend) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(config, backend, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_cls = Qwen3MoeModel
    # checkpoint expert projection -> FusedMoE shard id
    expert_shards = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}

    def map_checkpoint_name(self, name: str) -> list[tuple[str, Any, int | None]] | None:
        """Loader hook: expert tensors -> (param, shard id, expert id); None for the rest."""
        return map_expert_name(name, self.expert_shards, self.config.num_experts)

"""GPT-OSS: Llama's skeleton with attention sinks, per-layer sliding windows and a biased MoE.

What differs from Llama, as transformers' `modeling_gpt_oss.py` computes it:

* Attention: q/k/v/o biases (`attention_bias`), one sink logit per query head (checkpoint
  `self_attn.sinks`, owned here by the op: `self_attn.attn.sinks`), and a window of
  `sliding_window` keys on the layers whose `layer_types` entry is "sliding_attention" (full
  causal attention on "full_attention" layers). RoPE defaults to YaRN with truncate=False.
* MLP: every layer is sparse. The router (`mlp.router`, a linear layer with bias) gives one
  logit per expert; the top-k logits are softmaxed among themselves (not over all experts).
  Experts use the clamped SwiGLU `swigluoai` (see ops/moe.py) and have biases on both
  projections.

Checkpoint expert tensors are stacked over experts, transposed relative to our FusedMoE
and with gate/up interleaved column by column::

    mlp.experts.gate_up_proj       [E, H, 2I]  column 2i is gate unit i, column 2i+1 up unit i
    mlp.experts.gate_up_proj_bias  [E, 2I]     same interleaving
    mlp.experts.down_proj          [E, I, H]
    mlp.experts.down_proj_bias     [E, H]

`GptOssExperts.weight_loader` turns them into w13 [E, 2I, H] (rows [0, I) gate, [I, 2I) up)
and w2 [E, H, I]. MXFP4-quantised checkpoints (`*_blocks` / `*_scales`) are not supported.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.workers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from tandem.workers.models.qwen3_moe import Qwen3MoeModel, map_expert_name
from tandem.workers.ops.attention import Attention
from tandem.workers.ops.backend import KernelBackend
from tandem.workers.ops.linear import ReplicatedLinear
from tandem.workers.ops.moe import GATE, FusedMoE
from tandem.workers.ops.norm import RMSNorm

_LAYER_TYPES = ("sliding_attention", "full_attention")


def sliding_window_of(config: Any, layer_idx: int) -> int | None:
    """The layer's window in keys (None: full causal attention), from `layer_types`."""
    layer_type = config.layer_types[layer_idx]
    if layer_type not in _LAYER_TYPES:
        raise ValueError(f"layer_types[{layer_idx}]={layer_type!r} is not one of {_LAYER_TYPES}")
    return config.sliding_window if layer_type == "sliding_attention" else None


class GptOssAttention(LlamaAttention):
    def __init__(self, config: Any, backend: KernelBackend, layer_idx: int) -> None:
        super().__init__(config, backend)  # q/k/v/o biases follow config.attention_bias
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5,
                              self.num_kv_heads, backend,
                              sliding_window=sliding_window_of(config, layer_idx),
                              has_sinks=True)


class GptOssExperts(FusedMoE):
    """FusedMoE that loads GPT-OSS's stacked expert tensors (layout in the module docstring)."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str,
                      expert_id: int) -> None:
        super().weight_loader(param, self._one_expert(param, loaded, shard_id, expert_id),
                              shard_id, expert_id)

    def _one_expert(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str,
                    expert_id: int) -> torch.Tensor:
        """Expert `expert_id`'s part of a stacked checkpoint tensor, in FusedMoE's per-expert
        layout: gate or up [I, H] (bias [I]), down [H, I] (bias [H])."""
        num_experts, hidden_size = self.num_experts, self.w2.shape[1]
        full = self.intermediate_size * self.tp_size  # I before TP slicing
        if param is self.w13:
            expected = (num_experts, hidden_size, 2 * full)
        elif param is self.w13_bias:
            expected = (num_experts, 2 * full)
        elif param is self.w2:
            expected = (num_experts, full, hidden_size)
        else:
            expected = (num_experts, hidden_size)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expected GPT-OSS stacked expert shape {expected}, checkpoint has "
                             f"{tuple(loaded.shape)}")
        if not 0 <= expert_id < num_experts:
            raise ValueError(f"fused moe: expert_id={expert_id!r} not in [0, {num_experts})")
        one = loaded[expert_id]
        columns = slice(0, None, 2) if shard_id == GATE else slice(1, None, 2)
        if param is self.w13:
            return one[:, columns].t()  # [H, 2I] -> [I, H]
        if param is self.w13_bias:
            return one[columns]  # [2I] -> [I]
        if param is self.w2:
            return one.t()  # [I, H] -> [H, I]
        return one  # down bias [H]


class GptOssMLP(nn.Module):
    """Router with bias, softmax over the top-k logits, then the experts."""

    def __init__(self, config: Any, backend: KernelBackend) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = GptOssExperts(config.num_local_experts, config.hidden_size,
                                     config.intermediate_size, bias=True,
                                     activation="swigluoai",
                                     swiglu_alpha=getattr(config, "swiglu_alpha", 1.702),
                                     swiglu_limit=config.swiglu_limit,
                                     # AITER's fused_moe has no biases or clamped SwiGLU.
                                     backend=KernelBackend.TORCH)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        router_logits = self.router(hidden)  # [T, E]
        top_logits, topk_ids = torch.topk(router_logits, self.top_k, dim=-1)  # [T, k]
        topk_weights = torch.softmax(top_logits.float(), dim=-1)  # among the chosen k only
        return self.experts(hidden, topk_weights, topk_ids)


class GptOssDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (and its forward) with a windowed, sinked attention and the MoE MLP."""

    def __init__(self, config: Any, backend: KernelBackend, layer_idx: int) -> None:
        nn.Module.__init__(self)  # not Llama's __init__: it builds a dense MLP
        self.self_attn = GptOssAttention(config, backend, layer_idx)
        self.mlp = GptOssMLP(config, backend)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)


class GptOssModel(Qwen3MoeModel):
    """Llama's model forward; layers are built knowing their index (for `layer_types`)."""

    layer_cls = GptOssDecoderLayer


class GptOssForCausalLM(LlamaForCausalLM):
    model_cls = GptOssModel

    def map_checkpoint_name(self, name: str) -> list[tuple[str, Any, int | None]] | None:
        """Loader hook: sinks -> the attention op's parameter, stacked expert tensors ->
        (param, shard id, expert id) for every expert; None (the generic mapping) otherwise."""
        if name.endswith(".self_attn.sinks"):
            return [(name.removesuffix("sinks") + "attn.sinks", None, None)]
        if ".mlp.experts." in name and name.endswith(("_blocks", "_scales")):
            raise ValueError(f"checkpoint tensor {name!r}: MXFP4-quantised GPT-OSS experts are "
                             f"not supported; use a bf16 or fp32 checkpoint")
        return map_expert_name(name, {}, self.config.num_local_experts)

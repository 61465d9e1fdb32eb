"""DeepSeek-V3 / R1 (and Kimi K2, which ships this architecture) and DeepSeek-V2: multi-head
latent attention (MLA, see ops/mla.py) with a mixture of experts after the first dense layers.

Per layer, as transformers' `DeepseekV3DecoderLayer` / `DeepseekV2DecoderLayer`:
  * attention: q = q_b_proj(q_a_layernorm(q_a_proj(x))) with q_lora_rank, else q_proj(x);
    [c | k_pe] = kv_a_proj_with_mqa(x), c = kv_a_layernorm(c); RoPE on the last
    qk_rope_head_dim dims of every query head and on k_pe; kv_b_proj expands c into K_nope and V
    (inside the MLA op); o_proj over H * v_head_dim. q_a_proj, kv_a_proj_with_mqa and o_proj
    have biases when `attention_bias`. The two LoRA norms use eps 1e-6 whatever rms_norm_eps
    says (as transformers and DeepSeek's reference code).
  * RoPE pairs are interleaved (x[2i], x[2i+1]) for V2 and for V3 with `rope_interleave`
    (the default), NeoX halves otherwise. YaRN as configured; the softmax scale is
    qk_head_dim^-0.5 times mscale(factor, mscale_all_dim)^2 (rotary.yarn_softmax_scale).
  * MLP: layers [0, first_k_dense_replace) dense (`intermediate_size`); the others routed
    experts plus n_shared_experts always-on experts. V3 routes like GLM-4-MoE (sigmoid,
    e_score_correction_bias for choosing, grouped top-k, renormalised when norm_topk_prob,
    times routed_scaling_factor). V2 routes by softmax: `topk_method` "greedy" (plain top-k) or
    "group_limited_greedy" (best topk_group of n_group groups by their best expert), times
    routed_scaling_factor, renormalised when norm_topk_prob (as DeepSeek's code; transformers'
    V2 ignores that flag, which every released V2 checkpoint sets to false).

Checkpoint names are transformers'; layers at index >= num_hidden_layers (the multi-token
prediction heads V3 ships) are skipped.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.workers.models.glm4_moe import Glm4MoeForCausalLM, Glm4MoeSparseBlock
from tandem.workers.models.llama import LlamaMLP
from tandem.workers.models.qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeModel
from tandem.workers.ops.attention import AttentionMetadata
from tandem.workers.ops.backend import KernelBackend
from tandem.workers.ops.linear import (ColumnParallelLinear, ReplicatedLinear,
                                       RowParallelLinear, tp_rank_and_size)
from tandem.workers.ops.mla import MLAAttention
from tandem.workers.ops.norm import RMSNorm
from tandem.workers.ops.rotary import RotaryEmbedding, rope_parameters, yarn_softmax_scale

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: fixed, not config.rms_norm_eps


class DeepseekV3Attention(nn.Module):
    def __init__(self, config: Any, backend: KernelBackend) -> None:
        super().__init__()
        tp_size = tp_rank_and_size()[1]
        if config.num_attention_heads % tp_size:
            raise ValueError(f"num_attention_heads={config.num_attention_heads} is not "
                             f"divisible by the TP size {tp_size}")
        self.num_heads = config.num_attention_heads // tp_size  # on this TP rank
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        qk_head_dim = self.nope_dim + self.rope_dim
        bias = bool(getattr(config, "attention_bias", False))
        hidden, heads = config.hidden_size, config.num_attention_heads
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_head_dim)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LORA_NORM_EPS, backend)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_head_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope_dim,
                                                   bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS, backend)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank,
                                              heads * (self.nope_dim + self.v_head_dim))
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, hidden, bias)
        params = rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(
            self.rope_dim, config.max_position_embeddings, params, backend=backend,
            is_neox_style=not getattr(config, "rope_interleave", True))
        self.attn = self.build_attn(config, yarn_softmax_scale(params, qk_head_dim), backend)

    def build_attn(self, config: Any, scale: float, backend: KernelBackend) -> nn.Module:
        """The op that owns this layer's KV cache (DeepSeek-V3.2 swaps in sparse MLA)."""
        return MLAAttention(self.num_heads, self.nope_dim, self.rope_dim, self.v_head_dim,
                            self.kv_lora_rank, scale, backend)

    def attend(self, positions: torch.Tensor, hidden: torch.Tensor,
               q_latent: torch.Tensor | None, q_nope: torch.Tensor, q_pe: torch.Tensor,
               kv_c: torch.Tensor, k_pe: torch.Tensor, meta: AttentionMetadata
               ) -> torch.Tensor:
        """[T, H, Dv] from the projected (and roped) q and latents; hidden [T, D] is the
        layer's normed input and q_latent [T, q_lora_rank] the normed q LoRA latent (None
        without q_lora_rank), for subclasses that need them."""
        return self.attn(q_nope, q_pe, kv_c, k_pe, self.kv_b_proj.weight, meta)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q_latent = None
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(hidden))  # [T, q_lora_rank]
            q = self.q_b_proj(q_latent)
        q = q.view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)  # [T, H, Dn+P]
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim],
                                                           dim=-1)  # [T, R], [T, P]
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))  # [T, H|1, P]
        out = self.attend(positions, hidden, q_latent, q_nope, q_pe, kv_c, k_pe.squeeze(1),
                          meta)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_head_dim))


class DeepseekV2Router(nn.Module):
    """`gate`: logits [T, E] in fp32, as transformers computes them, from an fp32 weight (the
    checkpoint's values exactly; no conversion per step)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32),
                                   requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E] fp32
        return F.linear(hidden.float(), self.weight)


class DeepseekV2SparseBlock(Glm4MoeSparseBlock):
    """V3's block (experts + shared experts) with V2's softmax router and no correction bias."""

    TOPK_METHODS = ("greedy", "group_limited_greedy")

    def __init__(self, config: Any, backend: KernelBackend) -> None:
        super().__init__(config, backend)
        self.topk_method = getattr(config, "topk_method", None) or "greedy"
        if self.topk_method not in self.TOPK_METHODS:
            raise ValueError(f"topk_method={self.topk_method!r} is not supported (only "
                             f"{', '.join(map(repr, self.TOPK_METHODS))})")
        self.gate = DeepseekV2Router(config.hidden_size, config.n_routed_experts)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        is_grouped = self.topk_method == "group_limited_greedy"
        topk_weights, topk_ids = self.experts.select(
            self.gate(hidden), self.top_k, scoring="softmax", renormalize=self.renormalize,
            n_group=self.n_group if is_grouped else None,
            topk_group=self.topk_group if is_grouped else None,
            routed_scaling_factor=self.routed_scaling_factor)
        return self.experts(hidden, topk_weights, topk_ids) + self.shared_experts(hidden)


class DeepseekV3DecoderLayer(Qwen3MoeDecoderLayer):
    attention_cls = DeepseekV3Attention
    sparse_block_cls = Glm4MoeSparseBlock

    def build_mlp(self, config: Any, backend: KernelBackend, layer_idx: int) -> nn.Module:
        if getattr(config, "moe_layer_freq", 1) != 1:
            raise ValueError(f"moe_layer_freq={config.moe_layer_freq} is not supported (only 1)")
        if layer_idx < (config.first_k_dense_replace or 0):
            return LlamaMLP(config, backend)
        return self.sparse_block_cls(config, backend)


class DeepseekV2DecoderLayer(DeepseekV3DecoderLayer):
    sparse_block_cls = DeepseekV2SparseBlock


class DeepseekV3Model(Qwen3MoeModel):
    layer_cls = DeepseekV3DecoderLayer


class DeepseekV2Model(Qwen3MoeModel):
    layer_cls = DeepseekV2DecoderLayer


class DeepseekV3ForCausalLM(Glm4MoeForCausalLM):
    """GLM-4-MoE's checkpoint mapping (per-expert or stacked experts, MTP layers skipped);
    only the dense MLPs' gate/up are packed (the attention projections load as they are)."""

    model_cls = DeepseekV3Model
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    model_cls = DeepseekV2Model

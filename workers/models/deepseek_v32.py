"""DeepSeek-V3.2 (DeepseekV32ForCausalLM): DeepSeek-V3 (deepseek_v3.py) whose MLA attends only to
the tokens a per-layer lightning indexer selects (DeepSeek sparse attention, DSA).

Per layer, as transformers' `DeepseekV32Attention` / `DeepseekV32Indexer` (Hi = index_n_heads,
Di = index_head_dim, P = qk_rope_head_dim; x the layer's normed input, q_lat the q LoRA latent
q_a_layernorm(q_a_proj(x)) that V3's attention computes anyway):
  * indexer.wq_b:  q = wq_b(q_lat) as [Hi, Di]                            (no bias)
  * indexer.wk, indexer.k_norm:  k = LayerNorm(wk(x)) [Di], eps 1e-6, weight and bias
  * RoPE on the FIRST P dims of every q head and of k, NeoX halves (the main MLA ropes its
    last P dims with interleaved pairs), same frequencies and YaRN factor as the MLA's
  * indexer.weights_proj (fp32, as transformers keeps it): w = weights_proj(x) * Hi^-0.5
  * ops/indexer.py turns them into each query's top index_topk keys; ops/sparse_mla.py runs
    MLA under that selection and caches k beside the latent.
The rest is V3: Q-LoRA (required: the indexer reads its latent), interleaved RoPE (V3.2 configs
have no rope_interleave), MoE as V3; `mlp_layer_types` ("dense" / "sparse", derived from
first_k_dense_replace when absent) decides each layer's MLP. The indexer is replicated on every
TP rank (each rank selects the same keys for its share of the heads).

transformers computes the indexer without the Hadamard rotation and FP8 scoring of DeepSeek's
kernels (q.k is unchanged by the rotation; FP8 only rounds), and so does this model.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.workers.models.deepseek_v3 import (DeepseekV3Attention, DeepseekV3DecoderLayer,
                                               DeepseekV3ForCausalLM)
from tandem.workers.models.llama import LlamaMLP
from tandem.workers.models.qwen3_moe import Qwen3MoeModel
from tandem.workers.ops.attention import AttentionMetadata
from tandem.workers.ops.backend import KernelBackend
from tandem.workers.ops.indexer import IndexerInputs
from tandem.workers.ops.linear import ReplicatedLinear
from tandem.workers.ops.rotary import RotaryEmbedding, rope_parameters
from tandem.workers.ops.sparse_mla import SparseMLAAttention

INDEX_K_NORM_EPS = 1e-6  # indexer.k_norm: fixed, as transformers and DeepSeek's code


class Float32Projection(nn.Module):
    """x [T, D] -> fp32 [T, N] with an fp32 weight [N, D], whatever the model dtype (the
    indexer's head weights decide a discrete selection; transformers keeps them in fp32)."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=torch.float32),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class DeepseekV32Indexer(nn.Module):
    """The indexer's projections (checkpoint names `self_attn.indexer.*`) -> IndexerInputs."""

    def __init__(self, config: Any, backend: KernelBackend) -> None:
        super().__init__()
        self.num_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        rope_dim = config.qk_rope_head_dim
        if not 0 < rope_dim <= self.head_dim:
            raise ValueError(f"index_head_dim={self.head_dim} must be >= qk_rope_head_dim="
                             f"{rope_dim} (the indexer ropes its first qk_rope_head_dim dims)")
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.num_heads * self.head_dim)
        self.wk = ReplicatedLinear(config.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEX_K_NORM_EPS)
        self.weights_proj = Float32Projection(config.hidden_size, self.num_heads)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings,
                                          rope_parameters(config), rotary_dim=rope_dim,
                                          backend=backend, is_neox_style=True)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, q_latent: torch.Tensor
                ) -> IndexerInputs:
        """positions [T], hidden [T, D] (the layer's normed input), q_latent [T, q_lora_rank]."""
        q = self.wq_b(q_latent).view(-1, self.num_heads, self.head_dim)  # [T, Hi, Di]
        k = self.k_norm(self.wk(hidden))  # [T, Di]
        q, k = self.rotary_emb(positions, q, k.unsqueeze(1))
        weights = self.weights_proj(hidden) * self.num_heads ** -0.5  # [T, Hi] fp32
        return IndexerInputs(q, k.squeeze(1), weights)


class DeepseekV32Attention(DeepseekV3Attention):
    def __init__(self, config: Any, backend: KernelBackend) -> None:
        if config.q_lora_rank is None:
            raise ValueError("DeepSeek-V3.2 needs q_lora_rank: its indexer reads the q LoRA "
                             "latent")
        super().__init__(config, backend)
        self.indexer = DeepseekV32Indexer(config, backend)

    def build_attn(self, config: Any, scale: float, backend: KernelBackend) -> nn.Module:
        return SparseMLAAttention(self.num_heads, self.nope_dim, self.rope_dim, self.v_head_dim,
                                  self.kv_lora_rank, scale, config.index_head_dim,
                                  config.index_topk, backend)

    def attend(self, positions: torch.Tensor, hidden: torch.Tensor,
               q_latent: torch.Tensor | None, q_nope: torch.Tensor, q_pe: torch.Tensor,
               kv_c: torch.Tensor, k_pe: torch.Tensor, meta: AttentionMetadata
               ) -> torch.Tensor:
        index = self.indexer(positions, hidden, q_latent)
        return self.attn(q_nope, q_pe, kv_c, k_pe, self.kv_b_proj.weight, meta, index)


class DeepseekV32DecoderLayer(DeepseekV3DecoderLayer):
    attention_cls = DeepseekV32Attention  # sparse_block_cls: V3's

    def build_mlp(self, config: Any, backend: KernelBackend, layer_idx: int) -> nn.Module:
        layer_types = getattr(config, "mlp_layer_types", None)
        if layer_types is None:
            return super().build_mlp(config, backend, layer_idx)
        if layer_types[layer_idx] not in ("dense", "sparse"):
            raise ValueError(f"mlp_layer_types[{layer_idx}]={layer_types[layer_idx]!r} is "
                             f"not 'dense' or 'sparse'")
        if layer_types[layer_idx] == "dense":
            return LlamaMLP(config, backend)
        return self.sparse_block_cls(config, backend)


class DeepseekV32Model(Qwen3MoeModel):
    layer_cls = DeepseekV32DecoderLayer


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    model_cls = DeepseekV32Model

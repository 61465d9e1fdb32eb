"""Llama family (Llama 2/3/3.1, and the shared skeleton Qwen3 extends).

HF parameter names are kept, except that q/k/v and gate/up are packed into one matmul each
(`packed_modules_mapping` tells the loader where the checkpoint's tensors go).
Inputs are explicit: flat token ids [T], their positions [T] and the attention metadata.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from tandem.workers.ops import small_batch
from tandem.workers.ops.activation import SiluAndMul
from tandem.workers.ops.attention import Attention, AttentionMetadata
from tandem.workers.ops.backend import KernelBackend
from tandem.workers.ops.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.workers.ops.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                       RowParallelLinear)
from tandem.workers.ops.norm import RMSNorm
from tandem.workers.ops.rotary import RotaryEmbedding, rope_parameters


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, backend: KernelBackend) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim,
                                          config.num_attention_heads, num_kv_heads, bias)
        self.num_heads = self.qkv_proj.num_heads  # on this TP rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim,
                                        config.hidden_size, bias)
        self.rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings,
                                          rope_parameters(config), backend=backend)
        self.attn = Attention(self.num_heads, head_dim, head_dim ** -0.5, self.num_kv_heads,
                              backend)

    @property
    def qk_norm(self) -> tuple[nn.Module, nn.Module] | None:
        """(q norm, k norm) over each head's dims, or None: Llama has none; Qwen3 has one."""
        return None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(hidden), meta))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """qkv [T, (H + 2 KVH) D] -> attention output [T, H D], before o_proj."""
        num_tokens = qkv.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, meta, rope=(self.rotary_emb, positions),
                        qk_norm=self.qk_norm)  # [T, H, D]
        return out.reshape(num_tokens, q_size)


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, backend: KernelBackend) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias)
        self.act_fn = SiluAndMul(backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, config: Any, backend: KernelBackend) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, backend)
        self.mlp = LlamaMLP(config, backend)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)

    @functools.cached_property
    def _attention_fusable(self) -> bool:
        """Whether small batches can run the attention half (input norm, qkv, o) as fused
        GEMVs (workers/ops/small_batch.py); the MLP half follows `_mlp_fusable`."""
        attn = self.self_attn
        return (isinstance(attn, LlamaAttention)
                and small_batch.fusable((self.input_layernorm,), (attn.qkv_proj, attn.o_proj)))

    @functools.cached_property
    def _mlp_fusable(self) -> bool:
        """Whether the MLP half (post-attention norm, gate_up + SiLU*mul, down) fuses too: a
        dense Llama MLP. Other MLPs (experts) run after the post-attention norm as usual."""
        mlp = self.mlp
        return type(mlp) is LlamaMLP and small_batch.fusable(
            (self.post_attention_layernorm,), (mlp.gate_up_proj, mlp.down_proj))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if hidden.shape[0] <= small_batch.MAX_ROWS and self._attention_fusable:
            return self._forward_small_batch(positions, hidden, residual, meta)
        # The residual stream is carried separately so each norm can fuse the add before it.
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp_forward(hidden), residual

    def mlp_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The MLP on the post-attention norm's output (a hook for layers whose MLP output
        the next norm may take in another form: qwen3_moe)."""
        return self.mlp(hidden)

    def _forward_small_batch(self, positions: torch.Tensor, hidden: torch.Tensor,
                             residual: torch.Tensor | None, meta: AttentionMetadata
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same function as forward: five launches plus attention's (small_batch) for a
        dense layer; for another MLP (experts), the attention half fused and the MLP as
        forward runs it."""
        attn = self.self_attn
        qkv, residual = small_batch.norm_linear(hidden, residual, self.input_layernorm,
                                                attn.qkv_proj)
        hidden = small_batch.linear(attn.attend(positions, qkv, meta), attn.o_proj)
        return self._mlp_small_batch(hidden, residual)

    def _mlp_small_batch(self, hidden: torch.Tensor, residual: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP half of _forward_small_batch, from the post-attention add + norm on:
        fused GEMVs for a dense MLP, else the norm and the MLP as forward runs them."""
        mlp = self.mlp
        if not self._mlp_fusable:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return mlp(hidden), residual
        act, residual = small_batch.norm_linear(hidden, residual, self.post_attention_layernorm,
                                                mlp.gate_up_proj, silu_mul=True)
        return small_batch.linear(act, mlp.down_proj), residual


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer

    def __init__(self, config: Any, backend: KernelBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(config, backend)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, D]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    model_cls = LlamaModel
    # checkpoint module name -> (our packed module, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any, backend: KernelBackend = KernelBackend.TORCH) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)  # [T, D]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V]
        return self.lm_head.compute_logits(hidden)

"""Qwen3 (dense): Llama's skeleton plus an RMSNorm on each query and key head before RoPE."""
from __future__ import annotations

from typing import Any

from torch import nn

from tandem.workers.models.llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM,
                                         LlamaModel)
from tandem.workers.ops.backend import KernelBackend
from tandem.workers.ops.norm import RMSNorm


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: Any, backend: KernelBackend) -> None:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen3 with use_sliding_window=True is not supported yet")
        super().__init__(config, backend)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, backend)

    @property
    def qk_norm(self) -> tuple[nn.Module, nn.Module]:
        return self.q_norm, self.k_norm  # per head, over head_dim


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model

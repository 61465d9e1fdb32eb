"""Rotary position embedding (neox layout: rotate the two halves of the rotary dims).

Supported `rope_type`s: default, linear, llama3. Others (yarn, dynamic, longrope) raise a
ValueError naming the type, until a model family that needs them lands.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tandem.workers.ops.backend import KernelBackend, require_torch_backend


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of an HF config as one dict with `rope_type` and `rope_theta`.

    transformers >= 5 keeps them in `config.rope_parameters`; older configs use `rope_theta` plus
    an optional `rope_scaling` dict whose type key is `rope_type` or `type`.
    """
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def _inverse_frequencies(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base ** exponents)  # [rotary_dim / 2], fp32
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, params)
    raise ValueError(f"rope_type={rope_type!r} is not supported yet (supported: default, "
                     "linear, llama3)")


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: wavelengths longer than original_len / low_freq_factor are slowed by `factor`,
    # shorter than original_len / high_freq_factor kept, and the band between interpolated.
    factor = float(params["factor"])
    low = float(params["low_freq_factor"])
    high = float(params["high_freq_factor"])
    original_len = float(params["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original_len / low, inv_freq / factor, inv_freq)
    blend = (original_len / wavelength - low) / (high - low)
    interpolated = (1 - blend) * scaled / factor + blend * scaled
    in_band = (wavelength >= original_len / high) & (wavelength <= original_len / low)
    return torch.where(in_band, interpolated, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k in place of the token's absolute position.

    cos/sin are precomputed in fp32 for positions [0, max_position) and cast to the activation
    dtype at use, as transformers does.
    """

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any],
                 rotary_dim: int | None = None,
                 backend: KernelBackend = KernelBackend.TORCH) -> None:
        super().__init__()
        self.backend = require_torch_backend(backend, "rotary_embedding")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        if self.rotary_dim % 2 or self.rotary_dim > head_dim:
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and <= head_dim={head_dim}")
        inv_freq = _inverse_frequencies(self.rotary_dim, params)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.max_position = max_position
        # [max_position, rotary_dim / 2] each; buffers so .to(device) moves them.
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, H, D]; k [T, KVH, D] -> rotated (q, k)."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, R/2]
        sin = self.sin[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        rot, passthrough = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if passthrough.numel() == 0:
            return rotated
        return torch.cat((rotated, passthrough), dim=-1)

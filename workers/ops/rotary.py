"""Rotary position embedding over the first rotary_dim dims of each head (the rest pass through).

Supported `rope_type`s: default, linear, llama3, yarn (frequencies and cos/sin scaling exactly as
transformers computes them). Others (dynamic, longrope) raise a ValueError naming the type:
dynamic NTK rescales by each batch's longest sequence, which a shared table cannot follow.

Partial rotary: rotary_dim = int(head_dim * partial_rotary_factor) (GLM-4-MoE: 0.5).

Two layouts of the rotated pairs, as in vLLM's and AITER's rope kernels:

  is_neox_style=True   pairs (x[i], x[i + R/2]): Llama, Qwen, GPT-OSS, GLM-4-MoE
  is_neox_style=False  pairs (x[2i], x[2i + 1]), rotated in place (GPT-J): GLM-4 (dense),
                       DeepSeek-V3 with rope_interleave (transformers then returns the rotated
                       pairs de-interleaved, [evens | odds]; q.k is the same either way)
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tandem.workers.ops.backend import KernelBackend


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
    if getattr(config, "partial_rotary_factor", None) is not None:
        params.setdefault("partial_rotary_factor", config.partial_rotary_factor)
    if params["rope_type"] in ("llama3", "yarn"):
        # transformers falls back to the config's lengths for these (standardize_rope_params).
        original = getattr(config, "original_max_position_embeddings", None)
        params.setdefault("original_max_position_embeddings",
                          original or config.max_position_embeddings)
    if params["rope_type"] == "yarn" and params.get("factor") is None:
        params["factor"] = config.max_position_embeddings / params[
            "original_max_position_embeddings"]
    return params


def rotary_dim_of(head_dim: int, params: dict[str, Any]) -> int:
    """How many leading dims of a head are rotated (transformers' int(head_dim * factor))."""
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def _inverse_frequencies(rotary_dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """[rotary_dim / 2] fp32 inverse frequencies, and the factor cos/sin are multiplied by."""
    rope_type = params["rope_type"]
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(rotary_dim, params)
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base ** exponents)  # [rotary_dim / 2], fp32
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, params), 1.0
    raise ValueError(f"rope_type={rope_type!r} is not supported yet (supported: default, "
                     "linear, llama3, yarn)")


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


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inverse_frequencies(rotary_dim: int, params: dict[str, Any]
                              ) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers' _compute_yarn_parameters.

    Dims that turn more than beta_fast times over the original context keep their frequency,
    those turning fewer than beta_slow times are slowed by `factor`, with a linear ramp between
    (band edges floored/ceiled unless truncate is False, as GPT-OSS sets). cos/sin are scaled
    by attention_factor: given, or mscale(factor, mscale) / mscale(factor, mscale_all_dim) when
    both are set (DeepSeek), else 0.1 ln(factor) + 1.
    """
    for field in ("factor", "original_max_position_embeddings"):
        if params.get(field) is None:
            raise ValueError(f"rope_type='yarn' needs {field!r} in the rope parameters")
    base = float(params["rope_theta"])
    factor = float(params["factor"])
    original_len = params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def dim_turning(num_rotations: float) -> float:
        # The dim whose wavelength fits num_rotations times into the original context.
        return (rotary_dim * math.log(original_len / (num_rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: keep the original frequency; 0: fully interpolated
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq, float(attention_factor)


def yarn_softmax_scale(params: dict[str, Any], head_dim: int) -> float:
    """DeepSeek-V2/V3's softmax scale: head_dim^-0.5 * mscale(factor, mscale_all_dim)^2 for any
    scaled rope_type with mscale_all_dim set (transformers' yarn_apply_mscale); else head_dim^-0.5.
    """
    scale = head_dim ** -0.5
    mscale_all_dim = params.get("mscale_all_dim")
    if params.get("rope_type", "default") != "default" and mscale_all_dim:
        scale *= _yarn_mscale(float(params["factor"]), mscale_all_dim) ** 2
    return scale


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k in place of the token's absolute position.

    cos/sin are precomputed in fp32 for positions [0, max_position), times the rope type's
    attention factor (YaRN), and cast to the activation dtype at use, as transformers does.
    rotary_dim defaults to int(head_dim * params["partial_rotary_factor"]) (1.0 if absent).
    """

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any],
                 rotary_dim: int | None = None,
                 backend: KernelBackend = KernelBackend.TORCH, *,
                 is_neox_style: bool = True) -> None:
        super().__init__()
        if backend not in (KernelBackend.TORCH, KernelBackend.AITER_TRITON):
            raise ValueError(f"rotary_embedding: kernel backend {backend.value!r} is not "
                             "implemented")
        self.backend = backend
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or rotary_dim_of(head_dim, params)
        self.is_neox_style = is_neox_style
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and in "
                             f"(0, head_dim={head_dim}]")
        inv_freq, attention_factor = _inverse_frequencies(self.rotary_dim, params)
        self.attention_factor = attention_factor
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.max_position = max_position
        # [max_position, rotary_dim / 2] each; buffers so .to(device) moves them.
        self.register_buffer("cos", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, H, D]; k [T, KVH, D] -> rotated (q, k).

        On aiter-triton q and k are rotated in place (one kernel) and returned.
        """
        if self.backend is KernelBackend.AITER_TRITON and q.stride(-1) == 1 \
                and k.stride(-1) == 1:
            from tandem.workers.ops.gpu.rope import rotary_embedding_
            rotary_embedding_(positions, q, k, self.cos, self.sin, self.is_neox_style)
            return q, k
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, R/2]
        sin = self.sin[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        rot, passthrough = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        if passthrough.numel() == 0:
            return rotated
        return torch.cat((rotated, passthrough), dim=-1)

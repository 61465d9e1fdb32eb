"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged cache of latents.

Names, per token and per head h (H heads on this TP rank):

    R = kv_lora_rank, P = qk_rope_head_dim, Dn = qk_nope_head_dim, Dv = v_head_dim
    c    [R]      the compressed KV after kv_a_layernorm, shared by every head
    k_pe [P]      the roped key part, shared by every head
    q    [H, Dn + P] = [q_nope | q_pe], q_pe roped
    kv_b_proj.weight [H * (Dn + Dv), R], head-major; per head h the rows split into
      W_UK[h] [Dn, R] (key up-projection) and W_UV[h] [Dv, R] (value up-projection)

    k_h = [W_UK[h] c | k_pe]   v_h = W_UV[h] c
    out_h(q) = sum_j softmax_j(scale * q_h . k_h,j) v_h,j            -> [H, Dv]

Cache layout, per layer ONE tensor (the only KV the model keeps)::

    latent_cache: [num_blocks, block_size, 1, R + P]    row = [c | k_pe] of one token

Block tables, slot mapping and the flat mixed batch are those of `attention.py`
(`AttentionMetadata`): sequence i's queries are its last query_len positions and attend causally
to all seq_len cached positions (earlier chunks and prefix-cache hits included). An MHA cache of
the same model would hold H_total * (Dn + P + Dv) values per token and layer instead of R + P
(DeepSeek-V3: 40,960 against 576; see common/kv_layout.py).

Two exact rewrites of the same attention, chosen per sequence:

* prefill (query_len > 1): expand the latents of every visible position through kv_b_proj to
  full K_nope [S, H, Dn] and V [S, H, Dv], append k_pe to every head's key, and run causal
  attention. Costs S * R * H * (Dn + Dv) multiply-adds, amortised over the query_len queries.
* decode (query_len == 1): absorb the up-projections instead, never materialising K or V:
      q_h . k_h,j = (W_UK[h]^T q_nope,h) . c_j + q_pe,h . k_pe_j = [q_lat,h | q_pe,h] . row_j
      out_h = W_UV[h] (sum_j p_h,j c_j)
  i.e. multi-query attention with one "head" of size R + P (keys = cache rows, values = their
  first R entries), then one [R] -> [Dv] projection per head.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tandem.workers.ops.attention import AttentionMetadata, gather_kv
from tandem.workers.ops.backend import KernelBackend
from tandem.workers.ops.kv_cache import write_slots


class MLAAttention(nn.Module):
    """Owns one layer's latent cache; the model passes its kv_b_proj weight to every call (the
    up-projections live in the model, under their checkpoint name).

    Backends: torch (`mla_attention_torch`, any device) and aiter-triton (mla_gpu.py: our
    split-KV Triton decode kernel over the latent cache, SDPA for prefills)."""

    kv_cache_kind = "mla"  # common/kv_layout.py

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, kv_lora_rank: int, scale: float,
                 backend: KernelBackend = KernelBackend.TORCH) -> None:
        super().__init__()
        if backend not in (KernelBackend.TORCH, KernelBackend.AITER_TRITON):
            raise ValueError(f"mla_attention: kernel backend {backend.value!r} is not "
                             "implemented")
        self.backend = backend
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale
        self.latent_cache: torch.Tensor | None = None

    @property
    def supports_cuda_graphs(self) -> bool:
        """The torch reference reads host-side lengths (a CUDA graph would freeze them); the
        aiter-triton decode path reads lengths and block tables from device memory only."""
        return self.backend is KernelBackend.AITER_TRITON

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], ...]:
        return ((num_blocks, block_size, 1, self.latent_dim),)

    def check_kv_b_weight(self, kv_b_weight: torch.Tensor) -> None:
        expected = (self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
                    self.kv_lora_rank)
        if tuple(kv_b_weight.shape) != expected:
            raise ValueError(f"kv_b_proj weight shape {tuple(kv_b_weight.shape)} != {expected}")

    def bind_kv_cache(self, latent_cache: torch.Tensor) -> None:
        if latent_cache.dim() != 4 or tuple(latent_cache.shape[2:]) != (1, self.latent_dim):
            raise ValueError(f"latent cache shape {tuple(latent_cache.shape)} does not match "
                             f"(blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim = "
                             f"{self.latent_dim})")
        self.latent_cache = latent_cache

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                k_pe: torch.Tensor, kv_b_weight: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q_nope [T, H, Dn], q_pe [T, H, P] (roped), kv_c [T, R] (normed), k_pe [T, P] (roped),
        kv_b_weight [H * (Dn + Dv), R] -> [T, H, Dv]."""
        if self.latent_cache is None:
            raise RuntimeError("MLAAttention.forward before bind_kv_cache")
        self.check_kv_b_weight(kv_b_weight)
        if self.backend is KernelBackend.AITER_TRITON:
            from tandem.workers.ops.mla_gpu import mla_forward_gpu
            return mla_forward_gpu(self, q_nope, q_pe, kv_c, k_pe, kv_b_weight, meta)
        write_latent_cache(kv_c, k_pe, self.latent_cache, meta.slot_mapping)
        return mla_attention_torch(q_nope, q_pe, self.latent_cache, kv_b_weight, meta,
                                   self.scale, self.v_head_dim)


def write_latent_cache(kv_c: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Row slot_mapping[t] of the cache becomes [kv_c[t] | k_pe[t]]."""
    rows = torch.cat((kv_c, k_pe), dim=-1).to(latent_cache.dtype)  # [T, R + P]
    write_slots(latent_cache, slot_mapping, rows[:, None])


def mla_attention_torch(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                        kv_b_weight: torch.Tensor, meta: AttentionMetadata, scale: float,
                        v_head_dim: int,
                        masks: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """Reference MLA over the paged latent cache, one sequence at a time (module docstring).

    masks: per sequence None (causal attention) or an [L, S] bool mask, True where a query
    attends; it must already be causal (sparse attention: ops/indexer.py topk_visibility)."""
    num_tokens, num_heads, _ = q_nope.shape
    kv_lora_rank = kv_b_weight.shape[1]
    out = q_nope.new_empty(num_tokens, num_heads, v_head_dim)
    starts = meta.query_start_loc_host
    for i, seq_len in enumerate(meta.seq_lens_host):
        start, end = starts[i], starts[i + 1]
        mask = None if masks is None else masks[i]
        rows = gather_kv(latent_cache, meta.block_tables[i], seq_len)[:, 0]  # [S, R + P]
        rows = rows.to(q_nope.dtype)
        if end - start == 1:
            out[start:end] = _decode_absorbed(q_nope[start:end], q_pe[start:end], rows,
                                              kv_b_weight, scale, kv_lora_rank, v_head_dim,
                                              mask)
        else:
            out[start:end] = _prefill_expanded(q_nope[start:end], q_pe[start:end], rows,
                                               kv_b_weight, scale, kv_lora_rank, v_head_dim,
                                               mask)
    return out


def _prefill_expanded(q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor,
                      kv_b_weight: torch.Tensor, scale: float, kv_lora_rank: int,
                      v_head_dim: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """q_nope [L, H, Dn], q_pe [L, H, P], rows [S, R + P] -> [L, H, Dv]; the L queries are the
    last L of the S positions; mask [L, S] (True: attend) or None for causal."""
    query_len, num_heads, nope_dim = q_nope.shape
    seq_len = rows.shape[0]
    kv_c, k_pe = rows.split([kv_lora_rank, rows.shape[1] - kv_lora_rank], dim=-1)
    kv = F.linear(kv_c, kv_b_weight).view(seq_len, num_heads, nope_dim + v_head_dim)
    k_nope, v = kv.split([nope_dim, v_head_dim], dim=-1)  # [S, H, Dn], [S, H, Dv]
    k = torch.cat((k_nope, k_pe[:, None, :].expand(-1, num_heads, -1)), dim=-1)  # [S, H, Dn+P]
    q = torch.cat((q_nope, q_pe), dim=-1)  # [L, H, Dn + P]
    if mask is None:
        key_pos = torch.arange(seq_len, device=q.device)
        query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
        mask = key_pos[None, :] <= query_pos  # [L, S], causal
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, scale=scale)  # [H, L, Dv]
    return o.transpose(0, 1)


def _decode_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor,
                     kv_b_weight: torch.Tensor, scale: float, kv_lora_rank: int,
                     v_head_dim: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """One query: q_nope [1, H, Dn], q_pe [1, H, P], rows [S, R + P] -> [1, H, Dv]; mask [1, S]
    (True: attend) or None for every row."""
    _, num_heads, nope_dim = q_nope.shape
    w = kv_b_weight.view(num_heads, nope_dim + v_head_dim, kv_lora_rank)
    w_uk, w_uv = w.split([nope_dim, v_head_dim], dim=1)  # [H, Dn, R], [H, Dv, R]
    q_latent = torch.einsum("hd,hdr->hr", q_nope[0], w_uk)  # [H, R]
    q = torch.cat((q_latent, q_pe[0]), dim=-1)[:, None, :]  # [H, 1, R + P]
    # Multi-query attention: every head reads the same [S, R + P] keys and [S, R] values.
    o_latent = F.scaled_dot_product_attention(q, rows[None], rows[None, :, :kv_lora_rank],
                                              attn_mask=mask, scale=scale,
                                              enable_gqa=True)  # [H, 1, R]
    return torch.einsum("hr,hvr->hv", o_latent[:, 0], w_uv)[None]  # [1, H, Dv]

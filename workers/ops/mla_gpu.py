"""MLA on the aiter-triton backend: which kernel runs which kind of step (ops/mla.py has the math).

    step                                  kernel
    decode (every query_len == 1)         absorb W_UK (bmm), mla_decode_attention (ours,
                                            split-KV, graph-safe), then W_UV (bmm)
    prefill, any mix                      per sequence: expand the visible latents through
                                            kv_b_proj, then torch SDPA on 4-D [1, H, L, D] inputs

Prefill takes a fresh sequence's latents from this step's inputs and a sequence with cached
context (prefix hit, later chunk, or a decode row inside a mixed batch) from the paged cache.
SDPA's flash kernel wants equal q/k/v head dims: V (v_head_dim) is zero-padded to the q/k head
dim (qk_nope + qk_rope) in fp16/bf16 and the padding sliced off the output; fp32 has no flash
kernel, so there V keeps its width. A sequence with cached context passes a bottom-right
causal mask (its L queries are the last L of S positions), which SDPA's memory-efficient
kernel takes; a fresh one uses is_causal.

Nothing on the decode path reads host values that change between steps (the split count comes
from meta.max_seq_len, max_model_len under a CUDA graph): decode steps replay in graphs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tandem.workers.ops.attention import gather_kv
from tandem.workers.ops.gpu.device_info import num_sms
from tandem.workers.ops.gpu.mla_decode import (mla_decode_attention, mla_num_splits,
                                               write_latent_cache)

if TYPE_CHECKING:
    from tandem.workers.ops.attention import AttentionMetadata
    from tandem.workers.ops.mla import MLAAttention


def mla_forward_gpu(layer: MLAAttention, q_nope: torch.Tensor, q_pe: torch.Tensor,
                    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_b_weight: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
    """MLAAttention.forward's contract: q_nope [T, H, Dn], q_pe [T, H, P], kv_c [T, R],
    k_pe [T, P], kv_b_weight [H * (Dn + Dv), R] -> [T, H, Dv]; writes the latents first."""
    write_latent_cache(kv_c, k_pe, layer.latent_cache, meta.slot_mapping)
    if meta.max_query_len == 1:
        return _decode_absorbed(layer, q_nope, q_pe, kv_b_weight, meta)
    return _prefill_expanded(layer, q_nope, q_pe, kv_c, k_pe, kv_b_weight, meta)


def _split_kv_b(layer: MLAAttention, kv_b_weight: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Views W_UK [H, Dn, R] and W_UV [H, Dv, R] of kv_b_proj's weight (no copies)."""
    w = kv_b_weight.view(layer.num_heads, layer.qk_nope_head_dim + layer.v_head_dim,
                         layer.kv_lora_rank)
    return w.split([layer.qk_nope_head_dim, layer.v_head_dim], dim=1)


def _decode_absorbed(layer: MLAAttention, q_nope: torch.Tensor, q_pe: torch.Tensor,
                     kv_b_weight: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """One query per sequence, [B, H, *] -> [B, H, Dv]; launch shapes depend only on B."""
    w_uk, w_uv = _split_kv_b(layer, kv_b_weight)
    # [H, B, Dn] @ [H, Dn, R] -> [H, B, R]; the kernel reads it as [B, H, R] through strides.
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
    splits = mla_num_splits(q_nope.shape[0], layer.num_heads, meta.max_seq_len,
                            num_sms(q_nope.device))
    o_lat = mla_decode_attention(q_lat, q_pe, layer.latent_cache, meta.block_tables,
                                 meta.seq_lens, layer.scale, num_splits=splits)  # [B, H, R]
    # [H, B, R] @ [H, R, Dv] -> [H, B, Dv]
    return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def _prefill_expanded(layer: MLAAttention, q_nope: torch.Tensor, q_pe: torch.Tensor,
                      kv_c: torch.Tensor, k_pe: torch.Tensor, kv_b_weight: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
    """Per sequence: K/V of every visible position from its latent, then causal SDPA."""
    num_heads, nope_dim, v_dim = layer.num_heads, layer.qk_nope_head_dim, layer.v_head_dim
    rank = layer.kv_lora_rank
    qk_dim = nope_dim + layer.qk_rope_head_dim
    pad_v = v_dim != qk_dim and q_nope.dtype in (torch.float16, torch.bfloat16)
    out = q_nope.new_empty(q_nope.shape[0], num_heads, v_dim)
    starts = meta.query_start_loc_host
    for i, seq_len in enumerate(meta.seq_lens_host):
        start, end = starts[i], starts[i + 1]
        query_len = end - start
        if query_len == seq_len:  # nothing cached: this step's latents are all of them
            c, pe = kv_c[start:end], k_pe[start:end]
        else:
            rows = gather_kv(layer.latent_cache, meta.block_tables[i], seq_len)[:, 0]
            c, pe = rows[:, :rank].to(q_nope.dtype), rows[:, rank:].to(q_nope.dtype)
        kv = F.linear(c, kv_b_weight).view(seq_len, num_heads, nope_dim + v_dim)
        k_nope, v = kv.split([nope_dim, v_dim], dim=-1)  # [S, H, Dn], [S, H, Dv]
        k = torch.cat((k_nope, pe[:, None, :].expand(-1, num_heads, -1)), dim=-1)  # [S, H, Dq]
        q = torch.cat((q_nope[start:end], q_pe[start:end]), dim=-1)  # [L, H, Dq]
        if pad_v:
            v = F.pad(v, (0, qk_dim - v_dim))
        # [1, H, L|S, D]: the flash and memory-efficient kernels take 4-D inputs only.
        q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        if query_len == seq_len:
            o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=layer.scale)
        else:
            key_pos = torch.arange(seq_len, device=q.device)
            visible = key_pos[None, :] <= key_pos[seq_len - query_len:, None]  # [L, S]
            o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=visible, scale=layer.scale)
        out[start:end] = o[0, :, :, :v_dim].transpose(0, 1)
    return out

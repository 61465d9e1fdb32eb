"""Paged attention on the aiter-triton backend: which kernel runs which kind of step.

    step                                   kernel
    decode, <= 8 sequences, where it can   block_decode_attention (ours, CUDA: whole cache
      run (block_decode_supported)           blocks by TMA bulk copy, graph-safe)
    decode, otherwise                      paged_decode_attention (ours, Triton split-KV,
                                             graph-safe)
    prefill, nothing cached yet, no sinks  FlashAttention-4 where installed on Hopper, for
                                             several prompts or a long one (fa4_prefill.py),
                                             else torch SDPA (cuDNN / flash) on this step's own
                                             K/V, per sequence
    prefill over cached context (prefix-   FlashAttention-4 where installed on Hopper, for
      cache hits, later chunks), no sinks    256+ new tokens, no sliding window (paged)
    anything else (prefix-cache hits,      AITER unified_attention (paged, varlen, sinks,
      later chunks, sinks)                   sliding window)

Why: at small batch AITER's decode kernels leave most SMs idle (see paged_decode.py); up to 8
sequences the whole-block kernel reads KV faster than the Triton one, from 32 on the Triton
kernel is ahead. For fresh prompts torch SDPA's causal flash attention is faster than AITER's
Triton flash attention on NVIDIA GPUs, and on Hopper FlashAttention-4 beats both where it
applies (fa4_prefill.py); unified_attention reads a paged context for prefills that continue
earlier chunks wherever FA4 does not. bench/engine.py re-measures these choices;
the latest numbers are on bench/RESULTS.md.
A decode step on the whole-block kernel with full rotary applies its QK norm, RoPE and KV write
in that kernel's launch (block_decode.NewKeys); every other step runs gpu/rope.py's RoPE + KV
write launch first.
In float32 (a test dtype), prefills with cached context use the torch reference instead of
unified_attention, whose tl.dot rounds fp32 to tf32.

Nothing on the decode path reads host values that change between steps, so a CUDA graph
captured with meta.max_seq_len = max_model_len replays correctly at any context length.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tandem.workers.ops import kernel_options
from tandem.workers.ops.aiter_compat import load_aiter_triton
from tandem.workers.ops.backend import KernelBackend
from tandem.common.logging import get_logger
from tandem.workers.ops.gpu.block_decode import (
    NewKeys, block_decode_attention, block_splits_for, layout_reason, new_keys_reason)
from tandem.workers.ops.gpu.device_info import num_sms
from tandem.workers.ops.gpu.fa4_prefill import (
    fa4_paged_prefill_attention, fa4_prefill_attention, fa4_takes_fresh, fa4_takes_paged)
from tandem.workers.ops.gpu.kv_write import write_kv_cache
from tandem.workers.ops.gpu.paged_decode import num_splits_for, paged_decode_attention
from tandem.workers.ops.gpu.rope import fuses_qk_norm, rope_and_write_kv

if TYPE_CHECKING:
    from tandem.workers.ops.attention import Attention, AttentionMetadata

logger = get_logger(__name__)

BLOCK_DECODE_MAX_SEQS = 8  # above it the Triton split-KV kernel (see the module docstring)
# A decode step on the whole-block kernel applies its QK norm, RoPE and KV write inside that
# kernel (block_decode.NewKeys) rather than in rope_and_write_kv's launch before it.
ROPE_IN_BLOCK_DECODE = True


@functools.cache
def _unit_scale(device: torch.device) -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32, device=device)


def attention_forward_gpu(layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          meta: AttentionMetadata, rope: tuple | None = None,
                          qk_norm: tuple | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (this step's tokens) -> [T, H, D]; writes k/v to the cache.
    rope and qk_norm (Attention.forward): normed and rotated in place by the launch that writes
    the cache where that kernel can (gpu/rope.py), else by the modules first."""
    rotary = rope[0] if rope is not None else None
    in_kv_write = rotary is not None and rotary.backend is KernelBackend.AITER_TRITON \
        and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    fused_norm = _fused_qk_norm(q, rotary, qk_norm) if in_kv_write else None
    if qk_norm is not None and fused_norm is None:
        q, k = qk_norm[0](q), qk_norm[1](k)
    if in_kv_write and meta.max_query_len == 1:
        new = _new_keys_in_block_decode(q, k, v, layer, meta, rope, fused_norm)
        if new is not None:
            return decode_attention(q, layer.k_cache, layer.v_cache, meta, layer.scale,
                                    sliding_window=layer.sliding_window, sinks=layer.sinks,
                                    new_keys=new)
    if in_kv_write:
        rope_and_write_kv(rope[1], q, k, v, rotary.cos, rotary.sin, rotary.is_neox_style,
                          layer.k_cache, layer.v_cache, meta.slot_mapping, fused_norm)
    else:
        if rotary is not None:
            q, k = rotary(rope[1], q, k)
        write_kv_cache(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping)
    if meta.max_query_len == 1:
        return decode_attention(q, layer.k_cache, layer.v_cache, meta, layer.scale,
                                sliding_window=layer.sliding_window, sinks=layer.sinks)
    if layer.sinks is None and _nothing_cached(meta):
        out = None
        if fa4_takes_fresh(q, k, meta.num_seqs, q.shape[0], layer.sliding_window):
            out = fa4_prefill_attention(q, k, v, meta.query_start_loc, meta.max_query_len,
                                        layer.scale)
        if out is None:  # not taken, or refused (fa4_prefill.py)
            out = _fresh_prefill_sdpa(q, k, v, meta, layer.scale, layer.sliding_window)
        return out
    if layer.sinks is None and fa4_takes_paged(q, layer.k_cache, q.shape[0],
                                               layer.sliding_window):
        out = fa4_paged_prefill_attention(q, layer.k_cache, layer.v_cache, meta, layer.scale)
        if out is not None:
            return out
    if q.dtype == torch.float32:
        from tandem.workers.ops.attention import paged_attention_torch
        return paged_attention_torch(q, layer.k_cache, layer.v_cache, meta, layer.scale,
                                     sliding_window=layer.sliding_window, sinks=layer.sinks)
    out = torch.empty_like(q)
    scale_one = _unit_scale(q.device)
    load_aiter_triton().unified_attention(
        q, layer.k_cache, layer.v_cache, out, cu_seqlens_q=meta.query_start_loc,
        max_seqlen_q=meta.max_query_len, seqused_k=meta.seq_lens,
        max_seqlen_k=meta.max_seq_len, softmax_scale=layer.scale, causal=True,
        window_size=layer.window_size, block_table=meta.block_tables, softcap=0,
        q_descale=None, k_descale=scale_one, v_descale=scale_one, sinks=layer.sinks)
    return out


def use_block_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether decode_attention runs the whole-block kernel for this batch (its size, dtype,
    heads and cache layout; KernelOptions.block_decode, TANDEM_BLOCK_DECODE=0, turns it
    off)."""
    if q.shape[0] > BLOCK_DECODE_MAX_SEQS or not kernel_options.current().block_decode:
        return False
    return _block_decode_reason(q.device, q.dtype, q.shape[1], tuple(k_cache.shape),
                                k_cache.stride(), v_cache.stride(), k_cache.dtype,
                                v_cache.dtype) is None


@functools.cache
def _block_decode_reason(*layout) -> str | None:
    """block_decode.layout_reason, logged once per layout."""
    why = layout_reason(*layout)
    if why is None:
        logger.info("decode attention up to %d sequences: whole-block CUDA kernel",
                    BLOCK_DECODE_MAX_SEQS)
    else:
        logger.info("decode attention: Triton split-KV kernel only (whole-block kernel: %s)", why)
    return why


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, *,
                     sliding_window: int | None = None,
                     sinks: torch.Tensor | None = None, kernel: str | None = None,
                     new_keys: NewKeys | None = None) -> torch.Tensor:
    """One query token per sequence, through whichever kernel serves this batch faster
    (kernel: "blocks" or "triton" to pick one, for benchmarks), with the engine's split rule
    (max_seq_len, the longest context a captured graph serves). new_keys: q is raw and the
    whole-block kernel (which the caller has checked serves this batch) norms, rotates and
    caches the step's keys itself."""
    num_seqs, sms = q.shape[0], num_sms(q.device)
    if kernel == "blocks" or new_keys is not None \
            or (kernel is None and use_block_decode(q, k_cache, v_cache)):
        splits = block_splits_for(num_seqs, meta.max_seq_len, k_cache.shape[1], sms)
        return block_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                      scale, num_splits=splits, sliding_window=sliding_window,
                                      sinks=sinks, new_keys=new_keys)
    splits = num_splits_for(num_seqs, k_cache.shape[2], meta.max_seq_len, sms)
    return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                  num_splits=splits, sliding_window=sliding_window, sinks=sinks)


def _new_keys_in_block_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              layer: Attention, meta: AttentionMetadata, rope: tuple,
                              fused_norm: tuple | None) -> NewKeys | None:
    """The step's new keys for the whole-block kernel to norm, rotate and cache itself, or
    None where that kernel does not run this batch or cannot take them (new_keys_reason:
    partial rotary, for one). fused_norm is None without a QK norm or when the norm modules
    have already run."""
    if not ROPE_IN_BLOCK_DECODE or not use_block_decode(q, layer.k_cache, layer.v_cache):
        return None
    rotary = rope[0]
    new = NewKeys(k, v, rope[1], meta.slot_mapping, rotary.cos, rotary.sin,
                  rotary.is_neox_style, fused_norm)
    return new if new_keys_reason(q, new) is None else None


def _fused_qk_norm(q: torch.Tensor, rotary, qk_norm: tuple | None) -> tuple | None:
    """qk_norm's (q weight, k weight, eps) for rope_and_write_kv where that kernel can apply
    it (one eps for both, gpu/rope.fuses_qk_norm), else None: the modules run first."""
    if qk_norm is None:
        return None
    q_norm, k_norm = qk_norm
    fused = (q_norm.weight, k_norm.weight, q_norm.eps)
    return fused if q_norm.eps == k_norm.eps and fuses_qk_norm(q, rotary.cos.shape[1], fused) \
        else None


def _nothing_cached(meta: AttentionMetadata) -> bool:
    """Every sequence's queries are all of its keys (no prefix hit, no earlier chunk)."""
    starts = meta.query_start_loc_host
    return all(starts[i + 1] - starts[i] == seq_len
               for i, seq_len in enumerate(meta.seq_lens_host))


def _heads_repeated(x: torch.Tensor, group: int) -> torch.Tensor:
    """[L, KVH, D] -> [1, KVH * group, L, D], query head h reading KV head h // group (as
    repeat_interleave(group, dim=1) orders them): one strided copy into token-major rows, and
    none at all for group 1."""
    tokens, kv_heads, dim = x.shape
    rows = x[:, :, None, :].expand(tokens, kv_heads, group, dim)
    return rows.reshape(tokens, kv_heads * group, dim).transpose(0, 1).unsqueeze(0)


def _sdpa_takes_gqa(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether SDPA's flash or cuDNN kernel takes these [1, H, L, D] queries over [1, KVH, L, D]
    keys as they are (enable_gqa, causal, no mask). Either is what the default dispatch then
    runs; without them enable_gqa would fall to the math kernel, which builds the whole
    [H, L, L] score matrix (8 GiB at 8k tokens)."""
    if not q.is_cuda:
        return False
    params = torch.backends.cuda.SDPAParams(q, k, k, None, 0.0, True, True)
    return torch.backends.cuda.can_use_flash_attention(params, False) \
        or torch.backends.cuda.can_use_cudnn_attention(params, False)


def _fresh_prefill_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        meta: AttentionMetadata, scale: float, sliding_window: int | None,
                        gqa_in_kernel: bool | None = None) -> torch.Tensor:
    """Causal attention of each sequence over its own new K/V. Under GQA the kernel reads the
    K/V heads as they are where flash or cuDNN takes them (_sdpa_takes_gqa; gqa_in_kernel
    forces the choice, for tests), else they are repeated to the query heads first; a sliding
    window's mask always takes the repeated form. A lone sequence's output is returned as
    the kernel wrote it when that is already [L, H, D] row-major (the flash kernels write
    token-major), with no copy into a fresh tensor."""
    group = q.shape[1] // k.shape[1]
    starts = meta.query_start_loc_host
    lone = len(meta.seq_lens_host) == 1 and starts[1] - starts[0] == q.shape[0]
    out = None if lone else torch.empty_like(q)
    for i, seq_len in enumerate(meta.seq_lens_host):
        start, end = starts[i], starts[i + 1]
        # [1, H, L, D]: the flash kernel takes 4-D inputs only (3-D goes to the math kernel).
        qs = q[start:end].transpose(0, 1).unsqueeze(0)
        if sliding_window is None or seq_len <= sliding_window:
            ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (k, v))
            gqa = group > 1 and (gqa_in_kernel if gqa_in_kernel is not None
                                 else _sdpa_takes_gqa(qs, ks))
            if group > 1 and not gqa:
                ks, vs = (_heads_repeated(x[start:end], group) for x in (k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                               enable_gqa=gqa)
        else:
            ks, vs = (_heads_repeated(x[start:end], group) for x in (k, v))
            pos = torch.arange(seq_len, device=q.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - sliding_window)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        if lone:
            return o[0].transpose(0, 1).contiguous()  # no copy when already token-major
        out[start:end] = o[0].transpose(0, 1)
    return out

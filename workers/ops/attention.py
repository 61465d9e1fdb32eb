"""Paged attention: write this step's K/V into the block cache, then attend over it.

KV cache layout, per layer (what AITER's unified_attention reads as well)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

    sequence s with block_table [7, 2, 9], block_size 4, seq_len 10:
      positions 0-3 -> block 7, 4-7 -> block 2, 8-9 -> block 9 (slots 36, 37)

A batch is flat: the new tokens of every sequence concatenated ([T, ...]), delimited by
query_start_loc. Each sequence's queries are its last query_len positions and attend causally
to all seq_len positions (earlier chunks and prefix-cache hits included).

Two per-layer variants (GPT-OSS uses both), with the semantics of transformers and AITER:

* Sliding window W: the query at absolute position p sees keys in (p - W, p], i.e. W keys
  counting itself (transformers: kv_idx > q_idx - W). AITER's unified_attention spells the
  same window window_size=(W - 1, 0); no window is (-1, -1). See `Attention.window_size`.

    W = 3, seq_len 6, query at position 5:  keys 0 1 2 [3 4 5]

  The block manager still allocates (and keeps) every block of a windowed layer; freeing the
  blocks that slid out of every window is a later optimisation.
* Sinks: one learnable logit per query head that joins the softmax denominator but carries no
  value. With s_j = scale * q.k_j over the visible keys:

    out = sum_j exp(s_j) v_j / (exp(sink_h) + sum_j exp(s_j))

  The sink is a raw logit (not multiplied by scale), as in transformers' GPT-OSS eager
  attention and AITER's `sinks=` argument (float32 [num_query_heads]).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.workers.ops.backend import KernelBackend
from tandem.workers.ops.kv_cache import write_slots
from tandem.workers.ops.linear import tp_rank_and_size


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens sit in the paged cache. Built by the model runner."""

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset for each new token
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32: tokens in the cache after this step, per sequence
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies of query_start_loc / seq_lens so reference kernels never sync the device.
    query_start_loc_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


class Attention(nn.Module):
    """Stateless except for the KV cache tensors the model runner binds after allocating them,
    and, with `has_sinks`, the per-head sink logits.

    The op owns `sinks` ([num_heads] on this TP rank, float32 as AITER reads it) so every
    backend finds it in one place. A model keeps HF's checkpoint name by mapping it:
    packed_modules_mapping {"sinks": ("attn.sinks", None)} sends `self_attn.sinks` to
    `self_attn.attn.sinks`; its weight_loader takes this rank's heads from the full tensor.
    """

    kv_cache_kind = "mha"  # common/kv_layout.py

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 backend: KernelBackend = KernelBackend.TORCH, *,
                 sliding_window: int | None = None, has_sinks: bool = False) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} must be >= 1 (or None for none)")
        if backend not in (KernelBackend.TORCH, KernelBackend.AITER_TRITON):
            raise ValueError(f"attention: kernel backend {backend.value!r} is not implemented")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.backend = backend
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        if has_sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32),
                                      requires_grad=False)  # [H]
            self.sinks.weight_loader = self._load_sinks
        else:
            self.register_parameter("sinks", None)

    @property
    def supports_cuda_graphs(self) -> bool:
        """Only the aiter-triton decode path reads lengths from device memory alone."""
        return self.backend is KernelBackend.AITER_TRITON

    @property
    def window_size(self) -> tuple[int, int]:
        """The window as AITER's unified_attention takes it: (left, right), -1 for unbounded."""
        return (-1, -1) if self.sliding_window is None else (self.sliding_window - 1, 0)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: int | str | None = None) -> None:
        tp_rank, tp_size = tp_rank_and_size()
        if loaded.dim() == 1 and loaded.shape[0] == self.num_heads * tp_size:
            loaded = loaded.narrow(0, tp_rank * self.num_heads, self.num_heads)
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"sinks: expected shape {tuple(param.shape)} (or "
                             f"({self.num_heads * tp_size},) across TP), checkpoint has "
                             f"{tuple(loaded.shape)}")
        param.data.copy_(loaded)

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], ...]:
        """The cache tensors this layer needs, in bind_kv_cache's order: K, then V."""
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return shape, shape

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        expected = (self.num_kv_heads, self.head_dim)
        if tuple(k_cache.shape[2:]) != expected or k_cache.shape != v_cache.shape:
            raise ValueError(f"KV cache shape {tuple(k_cache.shape)} does not match "
                             f"(blocks, block_size, {expected[0]}, {expected[1]})")
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, rope: tuple[nn.Module, torch.Tensor] | None = None,
                qk_norm: tuple[nn.Module, nn.Module] | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H, D].

        qk_norm = (q norm, k norm): RMSNorms over each head's dims, applied first (Qwen3's QK
        norm). rope = (rotary embedding, positions [T]): q and k are rotated next. On
        aiter-triton both happen in the launch that writes the KV cache where that kernel
        supports them. Without rope, q and k arrive rotated.
        """
        if self.k_cache is None:
            raise RuntimeError("Attention.forward before bind_kv_cache")
        if self.backend is KernelBackend.AITER_TRITON:
            from tandem.workers.ops.attention_gpu import attention_forward_gpu
            return attention_forward_gpu(self, q, k, v, meta, rope, qk_norm)
        if qk_norm is not None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        if rope is not None:
            rotary, positions = rope
            q, k = rotary(positions, q, k)
        write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return paged_attention_torch(q, self.k_cache, self.v_cache, meta, self.scale,
                                     sliding_window=self.sliding_window, sinks=self.sinks)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    write_slots(k_cache, slot_mapping, k)
    write_slots(v_cache, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
              start: int = 0) -> torch.Tensor:
    """Positions [start, seq_len) of one sequence's K or V: [seq_len - start, KVH, D]."""
    block_size = cache.shape[1]
    first_block, end_block = start // block_size, -(-seq_len // block_size)
    blocks = cache.index_select(0, block_table[first_block:end_block].long())
    flat = blocks.reshape((end_block - first_block) * block_size, *cache.shape[2:])
    offset = start - first_block * block_size
    return flat[offset:offset + seq_len - start]


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float, *,
                          sliding_window: int | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Reference paged attention: per sequence, one attention call over the keys it can see.

    sliding_window and sinks follow the module docstring; sinks is [H] or None.
    """
    out = torch.empty_like(q)
    starts = meta.query_start_loc_host
    for i, seq_len in enumerate(meta.seq_lens_host):
        start, end = starts[i], starts[i + 1]
        query_len = end - start
        # Query j sits at absolute position seq_len - query_len + j. Keys before first_key lie
        # outside every query's window, so they are not even gathered.
        first_query_pos = seq_len - query_len
        first_key = 0 if sliding_window is None else max(0, first_query_pos - sliding_window + 1)
        k = gather_kv(k_cache, meta.block_tables[i], seq_len, first_key)
        v = gather_kv(v_cache, meta.block_tables[i], seq_len, first_key)
        mask = _visibility_mask(first_key, seq_len, query_len, sliding_window, q.device)
        out[start:end] = _attend(q[start:end], k, v, mask, scale, sinks)
    return out


def _visibility_mask(first_key: int, seq_len: int, query_len: int, sliding_window: int | None,
                     device: torch.device) -> torch.Tensor | None:
    """[query_len, seq_len - first_key] bool, True where the query sees the key; None if all.

    A single query (decode) sees every gathered key: first_key already cut the window.
    """
    if query_len == 1:
        return None
    key_pos = torch.arange(first_key, seq_len, device=device)
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    mask = key_pos[None, :] <= query_pos
    if sliding_window is not None:
        mask &= key_pos[None, :] > query_pos - sliding_window
    return mask


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [L, H, D], k/v [S, KVH, D], mask [L, S] or None -> [L, H, D]."""
    q, k, v = q.transpose(0, 1), k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
    if sinks is None:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        return o.transpose(0, 1)
    # SDPA has no sink term: spell the softmax out in fp32 with one extra logit per head.
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, 0).float()  # [H, S, D]
    v = v.repeat_interleave(group, 0).float()
    logits = torch.matmul(q.float(), k.transpose(1, 2)) * scale  # [H, L, S]
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(-1, 1, 1).expand(-1, logits.shape[1], 1)  # [H, L, 1]
    probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v).transpose(0, 1).to(q.dtype)

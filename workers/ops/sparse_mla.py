"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): MLA (mla.py) in which every query attends only
to the cached tokens the lightning indexer selects for it (indexer.py).

Cache, per layer, two tensors with the same blocks and slots (bind_kv_cache's order)::

    latent_cache:    [num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]   (mla.py)
    index_key_cache: [num_blocks, block_size, 1, index_head_dim]                   (indexer.py)

A step writes both rows of every new token, then per sequence scores its queries against the
index keys of all seq_len visible positions (earlier chunks and prefix-cache hits included) and
runs MLA's prefill or decode rewrite under the resulting [L, S] mask. A sequence no longer than
index_topk gets no mask: its attention is exactly causal MLA.

Every backend runs this torch reference (the latent expansion, the absorbed decode and the
indexer), on any device: the aiter-triton MLA kernels (mla_gpu.py) attend to every cached token
and take no selection, so they are not used here; a top-k sparse decode kernel is future work.
The reference reads host-side lengths, so decode steps do not replay in CUDA graphs.
"""
from __future__ import annotations

import torch

from tandem.workers.ops.attention import AttentionMetadata, gather_kv
from tandem.workers.ops.backend import KernelBackend
from tandem.workers.ops.indexer import IndexerInputs, topk_visibility, write_index_keys
from tandem.workers.ops.mla import MLAAttention, mla_attention_torch, write_latent_cache


class SparseMLAAttention(MLAAttention):
    kv_cache_kind = "mla_indexer"

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, kv_lora_rank: int, scale: float, index_head_dim: int,
                 index_topk: int, backend: KernelBackend = KernelBackend.TORCH) -> None:
        super().__init__(num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
                         kv_lora_rank, scale, backend)
        if index_topk < 1:
            raise ValueError(f"index_topk={index_topk} must be >= 1")
        self.index_head_dim = index_head_dim
        self.index_topk = index_topk
        self.index_key_cache: torch.Tensor | None = None

    @property
    def supports_cuda_graphs(self) -> bool:
        return False  # the torch reference on every backend (module docstring)

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], ...]:
        return ((num_blocks, block_size, 1, self.latent_dim),
                (num_blocks, block_size, 1, self.index_head_dim))

    def bind_kv_cache(self, latent_cache: torch.Tensor,
                      index_key_cache: torch.Tensor | None = None) -> None:
        if index_key_cache is None:
            raise ValueError("SparseMLAAttention needs an index key cache beside the latent "
                             "cache (kv_cache_shapes lists both)")
        expected = (*latent_cache.shape[:2], 1, self.index_head_dim)
        if tuple(index_key_cache.shape) != expected:
            raise ValueError(f"index key cache shape {tuple(index_key_cache.shape)} does not "
                             f"match (blocks, block_size, 1, index_head_dim) = {expected}")
        super().bind_kv_cache(latent_cache)
        self.index_key_cache = index_key_cache

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                k_pe: torch.Tensor, kv_b_weight: torch.Tensor, meta: AttentionMetadata,
                index: IndexerInputs | None = None) -> torch.Tensor:
        """MLAAttention.forward's tensors plus this step's indexer tensors -> [T, H, Dv]."""
        if self.latent_cache is None or self.index_key_cache is None:
            raise RuntimeError("SparseMLAAttention.forward before bind_kv_cache")
        if index is None:
            raise ValueError("SparseMLAAttention.forward needs the indexer's inputs")
        self.check_kv_b_weight(kv_b_weight)
        write_latent_cache(kv_c, k_pe, self.latent_cache, meta.slot_mapping)
        write_index_keys(index.k, self.index_key_cache, meta.slot_mapping)
        masks = []
        starts = meta.query_start_loc_host
        for i, seq_len in enumerate(meta.seq_lens_host):
            start, end = starts[i], starts[i + 1]
            keys = None
            if seq_len > self.index_topk:  # else no selection: skip the gather
                keys = gather_kv(self.index_key_cache, meta.block_tables[i], seq_len)[:, 0]
            masks.append(None if keys is None else topk_visibility(
                index.q[start:end], index.weights[start:end], keys, self.index_topk))
        return mla_attention_torch(q_nope, q_pe, self.latent_cache, kv_b_weight, meta,
                                   self.scale, self.v_head_dim, masks)

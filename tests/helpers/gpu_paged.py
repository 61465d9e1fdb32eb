"""Paged KV caches on the GPU for kernel tests: shuffled blocks, NaN wherever nothing was
written, so a kernel that reads an unwritten or wrong slot fails."""
from __future__ import annotations

import torch

from tandem.workers.ops.attention import AttentionMetadata

DEV = "cuda"


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def paged_case(seq_lens, query_lens, num_kv_heads, head_dim, block_size, dtype, seed):
    """Caches holding each sequence's keys in shuffled blocks (the rest NaN), and metadata."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    order = torch.randperm(num_blocks, generator=gen, device=DEV).tolist()
    tables, slots, starts = [], [], [0]
    for n, q_len, nb in zip(seq_lens, query_lens, blocks_per_seq):
        table, order = order[:nb], order[nb:]
        tables.append(table)
        for pos in range(n):
            slot = table[pos // block_size] * block_size + pos % block_size
            if pos >= n - q_len:
                slots.append(slot)  # this step writes it
            else:  # context from earlier steps
                k_cache.view(-1, num_kv_heads, head_dim)[slot] = torch.randn(
                    num_kv_heads, head_dim, generator=gen, device=DEV).to(dtype)
                v_cache.view(-1, num_kv_heads, head_dim)[slot] = torch.randn(
                    num_kv_heads, head_dim, generator=gen, device=DEV).to(dtype)
        starts.append(starts[-1] + q_len)
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEV),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32, device=DEV),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc_host=starts, seq_lens_host=list(seq_lens))
    return k_cache, v_cache, meta, gen

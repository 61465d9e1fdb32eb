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
    meta = paged_metadata(slots, starts, list(seq_lens), tables, max(query_lens))
    return k_cache, v_cache, meta, gen


def paged_metadata(slots: list[int], starts: list[int], seq_lens: list[int],
                   tables: list[list[int]], max_query_len: int,
                   device: str = DEV) -> AttentionMetadata:
    """A step's metadata on `device`: block tables padded with block 0 to the longest."""
    width = max(map(len, tables))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32, device=device),
        max_query_len=max_query_len, max_seq_len=max(seq_lens),
        query_start_loc_host=starts, seq_lens_host=seq_lens)


def replay_rope_write_then_attend(attend, seed: int, replays: int = 10):
    """The engine's decode pair in a CUDA graph: RoPE + KV write of the new keys, then
    attend(q, k_cache, v_cache, meta, out) (scale 128 ** -0.5, 16 q / 4 KV heads, head 128).
    The new keys' slots are NaN before every replay, so an attention kernel that reads one
    before the previous kernel wrote it (a PDL prefetch too early) poisons its output.
    Yields, after each replay: (out, reference out, the new keys as cached, reference keys)."""
    from tandem.workers.ops.attention import paged_attention_torch
    from tandem.workers.ops.backend import KernelBackend
    from tandem.workers.ops.gpu.rope import rope_and_write_kv
    from tandem.workers.ops.rotary import RotaryEmbedding
    k_cache, v_cache, meta, gen = paged_case([1, 64, 65, 700, 2049], [1] * 5, 4, 128, 16,
                                             torch.bfloat16, seed=seed)
    params = {"rope_type": "default", "rope_theta": 10000.0}
    rope = RotaryEmbedding(128, 4096, params, backend=KernelBackend.AITER_TRITON).to(DEV)
    positions = meta.seq_lens.long() - 1
    fresh = [torch.randn(5, h, 128, generator=gen, device=DEV).to(torch.bfloat16)
             for h in (16, 4, 4)]
    q, k, v = (t.clone() for t in fresh)
    out = torch.empty_like(q)
    new_slots = meta.slot_mapping

    def step():
        q.copy_(fresh[0])
        k.copy_(fresh[1])
        k_cache.view(-1, 4, 128).index_fill_(0, new_slots, float("nan"))
        v_cache.view(-1, 4, 128).index_fill_(0, new_slots, float("nan"))
        rope_and_write_kv(positions, q, k, v, rope.cos, rope.sin, rope.is_neox_style,
                          k_cache, v_cache, new_slots)
        attend(q, k_cache, v_cache, meta, out)
    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ref_q, ref_k = RotaryEmbedding(128, 4096, params).to(DEV)(positions, fresh[0].clone(),
                                                              fresh[1].clone())
    for _ in range(replays):
        graph.replay()
        ref = paged_attention_torch(ref_q, k_cache, v_cache, meta, 128 ** -0.5)
        yield out, ref, k_cache.view(-1, 4, 128)[new_slots], ref_k

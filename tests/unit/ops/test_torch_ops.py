"""The torch ops against independent references (transformers' modules, dense attention)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.workers.ops.attention import Attention, AttentionMetadata
from tandem.workers.ops.linear import MergedColumnParallelLinear, QKVParallelLinear
from tandem.workers.ops.norm import RMSNorm
from tandem.workers.ops.rotary import RotaryEmbedding, rope_parameters


def test_rms_norm_matches_transformers_with_fused_residual():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    ours, ref = RMSNorm(32, 1e-5), LlamaRMSNorm(32, eps=1e-5)
    ours.weight.data.normal_()
    ref.weight.data.copy_(ours.weight.data)
    x, residual = torch.randn(5, 32), torch.randn(5, 32)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)
    normed, summed = ours(x, residual)
    torch.testing.assert_close(summed, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref(x + residual), rtol=0, atol=0)


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
])
def test_rotary_matches_transformers(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (LlamaRotaryEmbedding,
                                                          apply_rotary_pos_emb)

    config = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=512,
                         rope_parameters=rope)
    ours = RotaryEmbedding(32, 512, rope_parameters(config))
    ref = LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 5, 63, 64, 200, 511])
    q, k = torch.randn(7, 2, 32), torch.randn(7, 1, 32)
    cos, sin = ref(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        cos, sin)
    q_out, k_out = ours(positions, q, k)
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="rope_type='longrope'"):
        RotaryEmbedding(32, 64, {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0})


def test_paged_attention_matches_dense_causal_attention():
    """Mixed batch: a fresh prefill, a chunk continuing earlier context, and two decodes, with
    blocks scattered through the cache."""
    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 16, 4
    attn = Attention(heads, dim, dim ** -0.5, kv_heads)
    attn.bind_kv_cache(torch.zeros(32, block, kv_heads, dim), torch.zeros(32, block, kv_heads, dim))
    # (context already cached, new tokens this step)
    layout = [(0, 9), (6, 5), (12, 1), (3, 1)]
    free = torch.randperm(32).tolist()
    tables, full_qkv = [], []
    for cached, new in layout:
        total = cached + new
        tables.append([free.pop() for _ in range(-(-total // block))])
        full_qkv.append((torch.randn(total, heads, dim), torch.randn(total, kv_heads, dim),
                         torch.randn(total, kv_heads, dim)))
    # Write the cached context directly into the cache.
    for (cached, _), table, (_, k, v) in zip(layout, tables, full_qkv):
        for pos in range(cached):
            attn.k_cache[table[pos // block], pos % block] = k[pos]
            attn.v_cache[table[pos // block], pos % block] = v[pos]
    q = torch.cat([fq[c:] for (c, _), (fq, _, _) in zip(layout, full_qkv)])
    k = torch.cat([fk[c:] for (c, _), (_, fk, _) in zip(layout, full_qkv)])
    v = torch.cat([fv[c:] for (c, _), (_, _, fv) in zip(layout, full_qkv)])
    slots, starts, lens = [], [0], []
    for (cached, new), table in zip(layout, tables):
        slots += [table[p // block] * block + p % block for p in range(cached, cached + new)]
        starts.append(starts[-1] + new)
        lens.append(cached + new)
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        max_query_len=9, max_seq_len=13, query_start_loc_host=starts, seq_lens_host=lens)
    out = attn(q, k, v, meta)
    for i, ((cached, new), (fq, fk, fv)) in enumerate(zip(layout, full_qkv)):
        dense = F.scaled_dot_product_attention(
            fq.transpose(0, 1), fk.repeat_interleave(2, 1).transpose(0, 1),
            fv.repeat_interleave(2, 1).transpose(0, 1), is_causal=True,
            scale=dim ** -0.5).transpose(0, 1)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], dense[cached:],
                                   rtol=1e-5, atol=1e-5)


def test_packed_linear_loaders_place_shards_and_check_shapes():
    qkv = QKVParallelLinear(hidden_size=8, head_dim=2, num_heads=4, num_kv_heads=2)
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)
    for shard, tensor in (("q", q), ("k", k), ("v", v)):
        qkv.weight.weight_loader(qkv.weight, tensor, shard)
    torch.testing.assert_close(qkv.weight.data, torch.cat([q, k, v]))
    with pytest.raises(ValueError, match="shard k"):
        qkv.weight.weight_loader(qkv.weight, torch.randn(5, 8), "k")
    merged = MergedColumnParallelLinear(4, [3, 3])
    gate, up = torch.randn(3, 4), torch.randn(3, 4)
    merged.weight.weight_loader(merged.weight, gate, 0)
    merged.weight.weight_loader(merged.weight, up, 1)
    torch.testing.assert_close(merged.weight.data, torch.cat([gate, up]))
    with pytest.raises(ValueError, match="shard_id=2"):
        merged.weight.weight_loader(merged.weight, up, 2)

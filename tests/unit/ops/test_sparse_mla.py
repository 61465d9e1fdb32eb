"""Sparse MLA (DeepSeek-V3.2) against its definition in float64: every query attends to the
index_topk earlier tokens of highest indexer score, on a flat batch that mixes a fresh prefill,
a chunk over cached latents and index keys, and decodes above and below index_topk."""
from __future__ import annotations

import pytest
import torch
from helpers.paged import scattered_batch

import tandem.workers.ops.indexer as indexer_mod
from tandem.workers.ops.indexer import IndexerInputs
from tandem.workers.ops.sparse_mla import SparseMLAAttention

HEADS, NOPE, ROPE, V_DIM, RANK, BLOCK, NUM_BLOCKS = 2, 8, 4, 6, 16, 4, 64
INDEX_HEADS, INDEX_DIM, TOPK = 4, 8, 10
SCALE = 0.2
# (tokens already cached, new tokens)
LAYOUT = [(0, 23), (17, 6), (30, 1), (5, 1), (0, 1), (9, 1)]
NAMES = {"q_nope": (HEADS, NOPE), "q_pe": (HEADS, ROPE), "kv_c": (RANK,), "k_pe": (ROPE,),
         "index_q": (INDEX_HEADS, INDEX_DIM), "index_k": (INDEX_DIM,),
         "index_w": (INDEX_HEADS,)}


def _batch(op: SparseMLAAttention, seed: int = 0):
    """Per-sequence random tensors; cached positions written straight into both caches of
    scattered blocks. Returns (per-sequence tensors, this step's flat inputs, metadata)."""
    gen = torch.Generator().manual_seed(seed)
    op.bind_kv_cache(*[torch.zeros(s) for s in op.kv_cache_shapes(NUM_BLOCKS, BLOCK)])
    tables, meta = scattered_batch(LAYOUT, NUM_BLOCKS, BLOCK, gen)
    full = []
    for (cached, new), table in zip(LAYOUT, tables):
        total = cached + new
        seq = {name: torch.randn(total, *shape, generator=gen) for name, shape in NAMES.items()}
        for pos in range(cached):
            block, offset = table[pos // BLOCK], pos % BLOCK
            op.latent_cache[block, offset, 0] = torch.cat((seq["kv_c"][pos], seq["k_pe"][pos]))
            op.index_key_cache[block, offset, 0] = seq["index_k"][pos]
        full.append(seq)
    step = {name: torch.cat([seq[name][c:] for (c, _), seq in zip(LAYOUT, full)])
            for name in NAMES}
    return full, step, meta


def _definition(seq, kv_b_weight, first_query_pos):
    """float64: the top-TOPK causal keys by indexer score, then MLA over exactly those."""
    total = len(seq["kv_c"])
    positions = torch.arange(total)
    causal = positions[None] <= positions[first_query_pos:, None]  # [L, S]
    dots = torch.einsum("lhd,sd->lhs", seq["index_q"].double()[first_query_pos:],
                        seq["index_k"].double()) * INDEX_DIM ** -0.5
    scores = torch.einsum("lh,lhs->ls", seq["index_w"].double()[first_query_pos:], dots.relu())
    scores = scores.masked_fill(~causal, float("-inf"))
    keep = torch.zeros_like(causal)
    keep.scatter_(1, scores.topk(min(TOPK, total), dim=1).indices, True)
    keep &= causal
    w = kv_b_weight.double().view(HEADS, NOPE + V_DIM, RANK)
    c = seq["kv_c"].double()
    k = torch.cat((torch.einsum("hdr,sr->shd", w[:, :NOPE], c),
                   seq["k_pe"].double()[:, None].expand(-1, HEADS, -1)), dim=-1)
    v = torch.einsum("hvr,sr->shv", w[:, NOPE:], c)
    q = torch.cat((seq["q_nope"], seq["q_pe"]), dim=-1).double()[first_query_pos:]
    logits = torch.einsum("lhd,shd->hls", q, k) * SCALE
    logits = logits.masked_fill(~keep, float("-inf"))
    return torch.einsum("hls,shv->lhv", logits.softmax(-1), v), keep


@pytest.mark.parametrize("max_score_elements", [indexer_mod.MAX_SCORE_ELEMENTS, 1])
def test_mixed_batch_matches_the_definition(monkeypatch, max_score_elements):
    """Also with the score tensor bounded to one query row at a time."""
    monkeypatch.setattr(indexer_mod, "MAX_SCORE_ELEMENTS", max_score_elements)
    op = SparseMLAAttention(HEADS, NOPE, ROPE, V_DIM, RANK, SCALE, INDEX_DIM, TOPK)
    weight = torch.randn(HEADS * (NOPE + V_DIM), RANK,
                         generator=torch.Generator().manual_seed(1)) * 0.3
    full, step, meta = _batch(op)
    index = IndexerInputs(step["index_q"], step["index_k"], step["index_w"])
    out = op(step["q_nope"], step["q_pe"], step["kv_c"], step["k_pe"], weight, meta, index)
    num_sparse = 0
    for i, ((cached, _), seq) in enumerate(zip(LAYOUT, full)):
        start, end = meta.query_start_loc_host[i], meta.query_start_loc_host[i + 1]
        expected, keep = _definition(seq, weight, cached)
        num_sparse += int((keep.sum(1) < torch.arange(cached, cached + len(keep)) + 1).sum())
        torch.testing.assert_close(out[start:end].double(), expected, rtol=1e-5, atol=1e-5)
    assert num_sparse >= 20  # queries that really dropped earlier keys
    # Both caches hold every new token's rows.
    latents = op.latent_cache.view(-1, RANK + ROPE)[meta.slot_mapping]
    torch.testing.assert_close(latents, torch.cat((step["kv_c"], step["k_pe"]), dim=-1))
    torch.testing.assert_close(op.index_key_cache.view(-1, INDEX_DIM)[meta.slot_mapping],
                               step["index_k"])


def test_sequences_within_index_topk_attend_causally():
    keys = torch.randn(TOPK, INDEX_DIM)
    q, w = torch.randn(3, INDEX_HEADS, INDEX_DIM), torch.randn(3, INDEX_HEADS)
    assert indexer_mod.topk_visibility(q, w, keys, TOPK) is None
    mask = indexer_mod.topk_visibility(q, w, torch.randn(TOPK + 1, INDEX_DIM), TOPK)
    assert mask.shape == (3, TOPK + 1)
    assert mask.sum(1).tolist() == [TOPK - 1, TOPK, TOPK]  # query 0 has TOPK - 1 keys: all


def test_bind_needs_both_caches():
    op = SparseMLAAttention(HEADS, NOPE, ROPE, V_DIM, RANK, SCALE, INDEX_DIM, TOPK)
    latent, index_keys = (torch.zeros(s) for s in op.kv_cache_shapes(3, BLOCK))
    assert index_keys.shape == (3, BLOCK, 1, INDEX_DIM) and op.kv_cache_kind == "mla_indexer"
    with pytest.raises(ValueError, match="needs an index key cache"):
        op.bind_kv_cache(latent)
    with pytest.raises(ValueError, match="index key cache shape"):
        op.bind_kv_cache(latent, torch.zeros(3, BLOCK, 1, INDEX_DIM + 1))

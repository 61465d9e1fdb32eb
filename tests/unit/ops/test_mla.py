"""The MLA op against MLA's definition (full per-head K/V from the latents, float64), on a flat
batch that mixes a fresh prefill, a chunk over cached latents, and decodes."""
from __future__ import annotations

import pytest
import torch
from helpers.paged import scattered_batch

import tandem.workers.ops.mla as mla_mod
from tandem.workers.ops.mla import MLAAttention

HEADS, NOPE, ROPE, V_DIM, RANK, BLOCK, NUM_BLOCKS = 4, 16, 8, 12, 32, 4, 40
SCALE = 0.17
# (tokens already cached, new tokens): fresh prefill, chunk after cached context, decodes
# (one right after a single cached token), and a one-token prompt.
LAYOUT = [(0, 9), (6, 5), (12, 1), (1, 1), (17, 1), (0, 1)]


def _batch(op: MLAAttention, layout, seed: int = 0):
    """Random per-sequence q/latents; cached positions written straight into op's cache (blocks
    scattered). Returns (per-sequence tensors, this step's flat inputs, metadata)."""
    gen = torch.Generator().manual_seed(seed)
    op.bind_kv_cache(*[torch.zeros(s) for s in op.kv_cache_shapes(NUM_BLOCKS, BLOCK)])
    tables, meta = scattered_batch(layout, NUM_BLOCKS, BLOCK, gen)
    full = []
    for (cached, new), table in zip(layout, tables):
        total = cached + new
        seq = dict(q_nope=torch.randn(total, HEADS, NOPE, generator=gen),
                   q_pe=torch.randn(total, HEADS, ROPE, generator=gen),
                   kv_c=torch.randn(total, RANK, generator=gen),
                   k_pe=torch.randn(total, ROPE, generator=gen))
        for pos in range(cached):
            op.latent_cache[table[pos // BLOCK], pos % BLOCK, 0] = torch.cat(
                (seq["kv_c"][pos], seq["k_pe"][pos]))
        full.append(seq)
    step = {name: torch.cat([seq[name][c:] for (c, _), seq in zip(layout, full)])
            for name in full[0]}
    return full, step, meta


def _definition(seq, kv_b_weight, first_query_pos):
    """MLA as written in the papers, float64: K = [W_UK c | k_pe], V = W_UV c per head."""
    w = kv_b_weight.double().view(HEADS, NOPE + V_DIM, RANK)
    c = seq["kv_c"].double()
    k_nope = torch.einsum("hdr,sr->shd", w[:, :NOPE], c)
    v = torch.einsum("hvr,sr->shv", w[:, NOPE:], c)
    k = torch.cat((k_nope, seq["k_pe"].double()[:, None].expand(-1, HEADS, -1)), dim=-1)
    q = torch.cat((seq["q_nope"], seq["q_pe"]), dim=-1).double()[first_query_pos:]
    logits = torch.einsum("lhd,shd->hls", q, k) * SCALE
    query_pos = torch.arange(first_query_pos, len(seq["kv_c"]))[:, None]
    logits = logits.masked_fill(torch.arange(len(seq["kv_c"]))[None] > query_pos, float("-inf"))
    return torch.einsum("hls,shv->lhv", logits.softmax(-1), v)


def _op(seed: int = 1):
    op = MLAAttention(HEADS, NOPE, ROPE, V_DIM, RANK, SCALE)
    weight = torch.randn(HEADS * (NOPE + V_DIM), RANK,
                         generator=torch.Generator().manual_seed(seed)) * 0.2
    return op, weight


def test_mixed_batch_matches_the_definition():
    op, weight = _op()
    full, step, meta = _batch(op, LAYOUT)
    out = op(step["q_nope"], step["q_pe"], step["kv_c"], step["k_pe"], weight, meta)
    assert out.shape == (sum(n for _, n in LAYOUT), HEADS, V_DIM)
    for i, ((cached, _), seq) in enumerate(zip(LAYOUT, full)):
        start, end = meta.query_start_loc_host[i], meta.query_start_loc_host[i + 1]
        expected = _definition(seq, weight, cached)
        assert torch.allclose(out[start:end].double(), expected, rtol=1e-5, atol=1e-5), i


def test_new_tokens_land_in_the_cache_as_latent_rows():
    op, weight = _op()
    full, step, meta = _batch(op, LAYOUT)
    op(step["q_nope"], step["q_pe"], step["kv_c"], step["k_pe"], weight, meta)
    rows = op.latent_cache.view(-1, RANK + ROPE)[meta.slot_mapping]
    assert torch.equal(rows, torch.cat((step["kv_c"], step["k_pe"]), dim=-1))


def test_decode_never_expands_the_latents(monkeypatch):
    """Single-query sequences take the absorbed path, which is the same attention."""
    op, weight = _op()
    decodes = [(c, n) for c, n in LAYOUT if n == 1]
    full, step, meta = _batch(op, decodes)

    def refuse(*args, **kwargs):
        raise AssertionError("decode expanded the latent cache into K/V")

    monkeypatch.setattr(mla_mod, "_prefill_expanded", refuse)
    out = op(step["q_nope"], step["q_pe"], step["kv_c"], step["k_pe"], weight, meta)
    for i, ((cached, _), seq) in enumerate(zip(decodes, full)):
        expected = _definition(seq, weight, cached)
        assert torch.allclose(out[i:i + 1].double(), expected, rtol=1e-5, atol=1e-5), i


def test_cache_shape_and_bad_bindings_are_named():
    op, weight = _op()
    assert op.kv_cache_shapes(7, 16) == ((7, 16, 1, RANK + ROPE),)
    with pytest.raises(ValueError, match=r"latent cache shape \(7, 16, 2, 40\)"):
        op.bind_kv_cache(torch.zeros(7, 16, 2, RANK + ROPE))
    _, step, meta = _batch(op, LAYOUT)
    with pytest.raises(ValueError, match="kv_b_proj weight shape"):
        op(step["q_nope"], step["q_pe"], step["kv_c"], step["k_pe"], weight[:, :-1], meta)

"""Our Triton kernels on CPU, under Triton's interpreter, against the torch reference ops.

Small shapes (the interpreter runs each program in Python), fp32 and fp16 (numpy has no
bfloat16). What these hold: indexing, masking, layouts, padding rows and the order of rounding;
speed and bf16 numerics are tests/gpu's. Run by tests/unit/ops/test_triton_interpreter.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.gpu_paged import paged_metadata, rel
from helpers.moe_cases import random_experts

from tandem.workers.engine.packed_inputs import INPUT_HEADER, input_header
from tandem.workers.ops.attention import AttentionMetadata, paged_attention_torch
from tandem.workers.ops.gpu import (add_rms_norm, decode_gemv, graph_inputs, kv_write,
                                    mla_decode, moe_decode, moe_prefill, paged_decode, rope,
                                    silu_and_mul)
from tandem.workers.ops.kv_cache import write_slots
from tandem.workers.ops.moe import select_experts, torch_fused_moe
from tandem.workers.ops.moe_aiter import align_by_expert as torch_align_by_expert
from tandem.workers.ops.norm import RMSNorm
from tandem.workers.ops.rotary import RotaryEmbedding

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def norm_module(dim: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6)
    norm.weight.data = torch.rand(dim, generator=torch.Generator().manual_seed(seed)) + 0.5
    return norm.to(dtype)


@DTYPES
def test_rms_norm_rows_heads_and_residual(dtype):
    torch.manual_seed(0)
    norm = norm_module(96, dtype, 1)
    x = torch.randn(7, 96).to(dtype)
    residual = torch.randn(7, 96).to(dtype)
    with torch.no_grad():
        want, want_sum = norm(x, residual.clone())
    got = add_rms_norm.rms_norm(x, norm.weight.data, 1e-6, residual)
    assert rel(got, want) <= TOL[dtype] and torch.equal(residual, want_sum)
    # Per-head rows read through the strides of a view out of a wider tensor (QK norm).
    head_norm = norm_module(32, dtype, 2)
    qkv = torch.randn(5, (6 + 2 + 2) * 32).to(dtype)
    q = qkv[:, :6 * 32].view(5, 6, 32)
    with torch.no_grad():
        assert rel(add_rms_norm.rms_norm(q, head_norm.weight.data, 1e-6), head_norm(q)) \
            <= TOL[dtype]


@DTYPES
@pytest.mark.parametrize("num_terms", [1, 3, 8])
def test_rms_norm_adds_the_terms_first(num_terms, dtype):
    """A [T, n, D] x with a residual: the n terms summed (fp32, rounded once), then added."""
    torch.manual_seed(num_terms)
    norm = norm_module(96, dtype, 3)
    wide = torch.randn(7, num_terms + 1, 96).to(dtype)
    terms = wide[:, 1:]  # rows num_terms + 1 apart: the term stride is read, not assumed
    residual = torch.randn(7, 96).to(dtype)
    summed = terms.float().sum(1).to(dtype)
    with torch.no_grad():
        want, want_sum = norm(summed, residual.clone())
        torch_path = norm(terms, residual.clone())
    got = add_rms_norm.rms_norm(terms, norm.weight.data, 1e-6, residual)
    assert got.shape == (7, 96) and rel(got, want) <= TOL[dtype]
    assert torch.allclose(residual, want_sum, rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(torch_path[1], want_sum) and torch.equal(torch_path[0], want)
    with pytest.raises(ValueError, match="do not match the residual"):
        add_rms_norm.rms_norm(terms, norm.weight.data, 1e-6, residual[:5])


@pytest.mark.parametrize("dtype", [torch.float16], ids=["fp16"])
def test_rms_norm_rounds_an_fp32_sum_to_the_residual_dtype(dtype):
    """x fp32 [T, D] (a MoE layer's sum, decode_moe(fp32_sum=True)) with a residual in the
    activation dtype: the same outputs, in that dtype, as for x rounded to it first; the torch
    path likewise."""
    torch.manual_seed(21)
    norm = norm_module(96, dtype, 5)
    x, residual = torch.randn(3, 96) * 3, torch.randn(3, 96).to(dtype)
    want_residual = residual.clone()
    want = add_rms_norm.rms_norm(x.to(dtype), norm.weight.data, 1e-6, want_residual)
    got = add_rms_norm.rms_norm(x, norm.weight.data, 1e-6, residual)
    assert got.dtype == dtype and torch.equal(got, want) and torch.equal(residual, want_residual)
    with torch.no_grad():
        torch_out, torch_sum = norm(x, residual.clone())
        torch_want, torch_want_sum = norm(x.to(dtype), residual.clone())
    assert torch_sum.dtype == dtype and torch.equal(torch_sum, torch_want_sum)
    assert torch.equal(torch_out, torch_want)
    with pytest.raises(ValueError, match="the residual's dtype or fp32"):
        add_rms_norm.rms_norm(x.double(), norm.weight.data, 1e-6, residual)


@DTYPES
@pytest.mark.parametrize("neox, partial", [(True, 1.0), (False, 1.0), (True, 0.5)])
def test_rope_and_kv_write(neox, partial, dtype):
    torch.manual_seed(1)
    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}
    rotary = RotaryEmbedding(32, 256, params, is_neox_style=neox)
    tokens, heads, kv_heads = 6, 4, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * 32).to(dtype)
    q, k, v = (t.view(tokens, -1, 32) for t in qkv.split([heads * 32, kv_heads * 32,
                                                          kv_heads * 32], dim=-1))
    positions = torch.randint(0, 256, (tokens,))
    slots = torch.randperm(5 * 4)[:tokens]
    slots[2] = -1  # a CUDA-graph padding row: rotated, never cached
    caches = [torch.zeros(5, 4, kv_heads, 32, dtype=dtype) for _ in range(4)]
    ref_q, ref_k = rotary(positions, q.clone(), k.clone())
    real = slots >= 0
    write_slots(caches[0], slots[real], ref_k[real])
    write_slots(caches[1], slots[real], v[real])
    rope.rope_and_write_kv(positions, q, k, v, rotary.cos, rotary.sin, neox, caches[2],
                           caches[3], slots)
    assert rel(q, ref_q) <= TOL[dtype] and rel(k, ref_k) <= TOL[dtype]
    assert rel(caches[2], caches[0]) <= TOL[dtype] and torch.equal(caches[3], caches[1])


@DTYPES
@pytest.mark.parametrize("neox", [True, False])
def test_rope_with_qk_norm(neox, dtype):
    """Qwen3's QK norm in the RoPE + KV-write launch: q, k and the cache as RMSNorm -> RoPE ->
    cache write give them."""
    torch.manual_seed(11)
    rotary = RotaryEmbedding(32, 256, {"rope_type": "default", "rope_theta": 10000.0},
                             is_neox_style=neox)
    norms = norm_module(32, dtype, 12), norm_module(32, dtype, 13)
    qkv = (torch.randn(5, (4 + 2 * 2) * 32) * 3).to(dtype)
    q, k, v = (t.view(5, -1, 32) for t in qkv.split([128, 64, 64], dim=-1))
    positions = torch.randint(0, 256, (5,))
    slots = torch.tensor([3, 17, -1, 8, 0])
    caches = [torch.zeros(5, 4, 2, 32, dtype=dtype) for _ in range(3)]
    with torch.no_grad():
        ref_q, ref_k = rotary(positions, norms[0](q.clone()), norms[1](k.clone()))
    real = slots >= 0
    write_slots(caches[0], slots[real], ref_k[real])
    rope.rope_and_write_kv(positions, q, k, v, rotary.cos, rotary.sin, neox, caches[1],
                           caches[2], slots, (norms[0].weight.data, norms[1].weight.data, 1e-6))
    assert rel(q, ref_q) <= TOL[dtype] and rel(k, ref_k) <= TOL[dtype]
    assert rel(caches[1], caches[0]) <= TOL[dtype]


@DTYPES
def test_kv_write_skips_padding_slots(dtype):
    torch.manual_seed(2)
    k, v = torch.randn(5, 2, 16).to(dtype), torch.randn(5, 2, 16).to(dtype)
    slots = torch.tensor([9, -1, 0, 13, 4])
    caches = [torch.zeros(4, 4, 2, 16, dtype=dtype) for _ in range(4)]
    write_slots(caches[0], slots[slots >= 0], k[slots >= 0])
    write_slots(caches[1], slots[slots >= 0], v[slots >= 0])
    kv_write.write_kv_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


@DTYPES
def test_silu_and_mul(dtype):
    x = torch.randn(3, 2 * 40).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    assert rel(silu_and_mul.silu_and_mul(x), F.silu(gate) * up) <= TOL[dtype]


@DTYPES
@pytest.mark.parametrize("fuse_norm, silu_mul", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("block_n", [1, 2, 8])
def test_fused_gemv(fuse_norm, silu_mul, block_n, dtype):
    torch.manual_seed(3)
    x = torch.randn(1, 160).to(dtype)
    weight = (torch.randn(48, 160) / 160 ** 0.5).to(dtype)
    residual = torch.randn(1, 160).to(dtype) if fuse_norm else None
    norm = norm_module(160, dtype, 4)
    h, want_residual = x, None
    if fuse_norm:
        with torch.no_grad():
            h, want_residual = norm(x, residual.clone())
    want = F.linear(h.float(), weight.float())
    if silu_mul:
        gate, up = want.to(dtype).float().chunk(2, dim=-1)
        want = F.silu(gate) * up
    config = {"block_n": block_n, "block_k": 64, "num_warps": 4, "num_stages": 1}
    got, new_residual = decode_gemv.fused_gemv(
        x, weight, residual=residual, norm_weight=norm.weight.data if fuse_norm else None,
        eps=1e-6, silu_mul=silu_mul, config=config)
    assert rel(got, want) <= TOL[dtype]
    if fuse_norm:
        assert torch.equal(new_residual, want_residual)
        # x as an fp32 row (a MoE layer's sum, decode_moe(fp32_sum=True)): rounded to the
        # residual's dtype first, so every output equals the one for that rounded row.
        x32 = x.float() + torch.randn(1, 160) * 1e-3
        got32, residual32 = decode_gemv.fused_gemv(
            x32, weight, residual=residual, norm_weight=norm.weight.data, eps=1e-6,
            silu_mul=silu_mul, config=config)
        want32, want_residual32 = decode_gemv.fused_gemv(
            x32.to(dtype), weight, residual=residual, norm_weight=norm.weight.data, eps=1e-6,
            silu_mul=silu_mul, config=config)
        assert got32.dtype == residual32.dtype == dtype
        assert torch.equal(got32, want32) and torch.equal(residual32, want_residual32)


@DTYPES
@pytest.mark.parametrize("config", [None, {"block_n": 8, "block_k": 64, "num_warps": 4,
                                           "num_stages": 1}])
def test_fused_gemv_keeps_the_normed_row(config, dtype):
    """normed_out (a MoE router's GEMV keeping the experts' input): RMSNorm's output exactly,
    with the default settings for a narrow output (one column a program) and with 8 columns."""
    torch.manual_seed(14)
    x, residual = torch.randn(1, 200).to(dtype), torch.randn(1, 200).to(dtype)
    weight = (torch.randn(16, 200) / 200 ** 0.5).to(dtype)
    norm = norm_module(200, dtype, 15)
    with torch.no_grad():
        want_normed, want_residual = norm(x, residual.clone())
    normed = torch.full_like(x, float("nan"))
    logits, new_residual = decode_gemv.fused_gemv(
        x, weight, residual=residual, norm_weight=norm.weight.data, eps=1e-6, normed_out=normed,
        config=config)
    assert torch.equal(normed, want_normed) and torch.equal(new_residual, want_residual)
    assert rel(logits, F.linear(want_normed.float(), weight.float())) <= TOL[dtype]
    normed.fill_(float("nan"))  # the same from x as an fp32 row rounding to x
    decode_gemv.fused_gemv(x.float(), weight, residual=residual, norm_weight=norm.weight.data,
                           eps=1e-6, normed_out=normed, config=config)
    assert torch.equal(normed, want_normed)
    with pytest.raises(ValueError, match="needs x's shape and x in its dtype or fp32"):
        decode_gemv.fused_gemv(x.double(), weight, residual=residual,
                               norm_weight=norm.weight.data)


def paged_metadata_cpu(seq_lens: list[int], block_size: int, num_blocks: int, seed: int
                       ) -> tuple[AttentionMetadata, list[list[int]]]:
    """Decode metadata (one new token per sequence) over shuffled blocks."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = []
    for n in seq_lens:
        count = -(-n // block_size)
        tables.append(order[:count])
        order = order[count:]
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size
             for t, n in zip(tables, seq_lens)]
    meta = paged_metadata(slots, list(range(len(seq_lens) + 1)), list(seq_lens), tables, 1,
                          device="cpu")
    return meta, tables


@DTYPES
@pytest.mark.parametrize("num_splits, window, with_sinks", [(1, None, False), (4, None, False),
                                                            (2, 9, False), (2, None, True)])
def test_paged_decode_attention(num_splits, window, with_sinks, dtype):
    torch.manual_seed(5)
    seq_lens, block_size, kv_heads, heads, dim = [1, 20, 37], 8, 2, 4, 32
    meta, _ = paged_metadata_cpu(seq_lens, block_size, 12, seed=6)
    k_cache = torch.randn(12, block_size, kv_heads, dim).to(dtype)
    v_cache = torch.randn(12, block_size, kv_heads, dim).to(dtype)
    q = torch.randn(3, heads, dim).to(dtype)
    sinks = torch.randn(heads) if with_sinks else None  # GPT-OSS's per-head sink logits
    want = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), meta,
                                 dim ** -0.5, sliding_window=window, sinks=sinks)
    got = paged_decode.paged_decode_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, dim ** -0.5,
        num_splits=num_splits, sliding_window=window, sinks=sinks, block_n=16)
    assert rel(got, want) <= TOL[dtype]


@DTYPES
@pytest.mark.parametrize("num_splits", [1, 4])
def test_mla_decode_attention(num_splits, dtype):
    torch.manual_seed(7)
    seq_lens, block_size, heads, rank, rope_dim = [3, 29], 8, 4, 32, 16
    meta, tables = paged_metadata_cpu(seq_lens, block_size, 6, seed=8)
    latent = torch.randn(6, block_size, 1, rank + rope_dim).to(dtype)
    q_lat = torch.randn(2, heads, rank).to(dtype)
    q_pe = torch.randn(2, heads, rope_dim).to(dtype)
    scale = 0.1
    want = []
    for b, n in enumerate(seq_lens):
        rows = latent[tables[b]].reshape(-1, rank + rope_dim)[:n].float()  # [S, R + P]
        scores = (q_lat[b].float() @ rows[:, :rank].T + q_pe[b].float() @ rows[:, rank:].T)
        want.append(torch.softmax(scores * scale, dim=-1) @ rows[:, :rank])  # [H, R]
    got = mla_decode.mla_decode_attention(q_lat, q_pe, latent, meta.block_tables,
                                          meta.seq_lens, scale, num_splits=num_splits)
    assert rel(got, torch.stack(want)) <= TOL[dtype]
    # The latent write: [kv_c | k_pe] rows at the slots, a padding slot writes nothing.
    kv_c, k_pe = torch.randn(3, rank).to(dtype), torch.randn(3, rope_dim).to(dtype)
    slots = torch.tensor([5, -1, 40])
    cache, want_cache = torch.zeros_like(latent), torch.zeros_like(latent)
    write_slots(want_cache, slots[slots >= 0], torch.cat((kv_c, k_pe), -1)[slots >= 0][:, None])
    mla_decode.write_latent_cache(kv_c, k_pe, cache, slots)
    assert torch.equal(cache, want_cache)


def experts(num_tokens: int, num_experts: int, hidden: int, size: int, dtype: torch.dtype,
            seed: int):
    """helpers.moe_cases.random_experts on the CPU, and router logits from the same draws."""
    gen, x, w13, w2 = random_experts(num_tokens, num_experts, hidden, size, seed, dtype, "cpu")
    return x, w13, w2, torch.randn(num_tokens, num_experts, generator=gen).to(dtype)


@DTYPES
@pytest.mark.parametrize("num_tokens, top_k", [(1, 4), (1, 1), (1, 8), (3, 2), (6, 1)])
def test_moe_decode(num_tokens, top_k, dtype):
    x, w13, w2, logits = experts(num_tokens, 8, 48, 24, dtype, seed=num_tokens)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    want = torch_fused_moe(x, w13, w2, weights, ids)
    routed = moe_decode.decode_moe(x, w13, w2, router_logits=logits, top_k=top_k)
    given = moe_decode.decode_moe(x, w13, w2, topk_weights=weights, topk_ids=ids)
    assert rel(routed, want) <= TOL[dtype] and rel(given, want) <= TOL[dtype]
    for by_pair, width in ((True, 64), (False, 64), (True, 16)):
        # both grids, whichever the pair count picks by default; gate_up slabs of 16 columns
        # (two, the second masked past the 24), as default_config picks for a small batch
        config = {**moe_decode.default_config(num_tokens * top_k), "by_pair": by_pair,
                  "gate_up_block_n": width}
        out = moe_decode.decode_moe(x, w13, w2, topk_weights=weights, topk_ids=ids,
                                    config=config)
        assert rel(out, want) <= TOL[dtype], (by_pair, width)
    terms = moe_decode.decode_moe(x, w13, w2, topk_weights=weights, topk_ids=ids, terms=True)
    assert terms.shape == (num_tokens, top_k, 48)  # the sum over k left to the caller
    assert rel(terms.float().sum(1).to(dtype), given) <= TOL[dtype]
    for by_pair in (True, False):  # the sum added by the down kernel, in fp32
        config = {**moe_decode.default_config(num_tokens * top_k), "by_pair": by_pair}
        fp32_sum = moe_decode.decode_moe(x, w13, w2, topk_weights=weights, topk_ids=ids,
                                         config=config, fp32_sum=True)
        assert fp32_sum.shape == (num_tokens, 48) and fp32_sum.dtype == torch.float32
        assert rel(fp32_sum.to(dtype), given) <= TOL[dtype], by_pair
    with pytest.raises(ValueError, match="pick one"):
        moe_decode.decode_moe(x, w13, w2, topk_weights=weights, topk_ids=ids, terms=True,
                              fp32_sum=True)
    got_w, got_ids = moe_decode.route(logits, top_k, True)
    assert torch.equal(got_ids.long().sort(1).values, ids.sort(1).values)


@pytest.mark.parametrize("hidden", [moe_decode.SUM_BLOCK_N * 2 + 40])
def test_moe_decode_sums_every_hidden_column(hidden):
    """The sum over k spans the hidden size in several programs: every column of every token
    is summed, the partial last block included."""
    x, w13, w2, logits = experts(2, 4, hidden, 16, torch.float32, seed=3)
    weights, ids = select_experts(logits, 2, renormalize=True)
    want = torch_fused_moe(x, w13, w2, weights, ids)
    out = moe_decode.decode_moe(x, w13, w2, topk_weights=weights, topk_ids=ids)
    assert rel(out, want) <= TOL[torch.float32]
    # The fp32 sum spans more values than one zeroing store: every one is zeroed, then summed.
    assert 2 * hidden > moe_decode.ZERO_BLOCK
    fp32_sum = moe_decode.decode_moe(x, w13, w2, topk_weights=weights, topk_ids=ids,
                                     fp32_sum=True)
    assert rel(fp32_sum, want) <= TOL[torch.float32]


SIGMOID_GROUPED = dict(scoring="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, routing", [
    (37, 128, 8, dict(renormalize=True)),  # three programs of 16 tokens, the last partial
    (300, 8, 2, dict(renormalize=False)),  # 256 tokens a program
    (5, 60, 4, dict(renormalize=True)),    # experts short of a power of two
    (1, 128, 8, dict(renormalize=True)),   # a decode step's single token
    # DeepSeek-V3: sigmoid, correction bias, 4 of 8 groups by their top two, scaled
    (11, 256, 8, dict(renormalize=True, bias=True, **SIGMOID_GROUPED)),
    (3, 64, 6, dict(renormalize=False, bias=True, **SIGMOID_GROUPED)),
    # DeepSeek-V2: softmax, groups by their best expert, scaled
    (9, 64, 6, dict(renormalize=False, n_group=8, topk_group=3, routed_scaling_factor=16.0)),
    # GLM-4.5: sigmoid and a bias, no groups, 160 experts
    (20, 160, 8, dict(renormalize=True, bias=True, scoring="sigmoid", n_group=1,
                      topk_group=1, routed_scaling_factor=2.5))])
def test_route_matches_select_experts(num_tokens, num_experts, top_k, routing):
    """moe_decode.route against select_experts with the same arguments: the same experts with
    the same weights for every token of every program, best first; tied choices go to the
    lower expert id first (select_experts leaves the order open)."""
    gen = torch.Generator().manual_seed(num_tokens)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    routing = dict(routing)
    if routing.pop("bias", False):
        routing["e_score_correction_bias"] = torch.randn(num_experts, generator=gen) * 0.5
    want_w, want_ids = select_experts(logits, top_k, **routing)
    got_w, got_ids = moe_decode.route(logits, top_k, **routing)

    def by_id(w, ids):
        ids, order = ids.long().sort(1)
        return ids, w.float().gather(1, order)

    (got_sorted, got_w_sorted), (want_sorted, want_w_sorted) = by_id(got_w, got_ids), \
        by_id(want_w, want_ids)
    assert torch.equal(got_sorted, want_sorted)
    torch.testing.assert_close(got_w_sorted, want_w_sorted, rtol=1e-5, atol=1e-6)
    choice = logits.gather(1, got_ids.long())  # best first: scores are monotonic in logits
    if "e_score_correction_bias" not in routing:
        assert (choice[:, :-1] >= choice[:, 1:]).all()
    if routing.get("n_group", 1) > 1:
        return
    logits[-1, 1:top_k + 2] = 5.0  # k + 1 experts tied for the top
    if "e_score_correction_bias" in routing:
        routing["e_score_correction_bias"] = torch.zeros(num_experts)
    _, tied_ids = moe_decode.route(logits, top_k, **routing)
    assert tied_ids[-1].tolist() == list(range(1, top_k + 1))


@DTYPES
def test_moe_prefill(dtype):
    x, w13, w2, logits = experts(40, 8, 64, 32, dtype, seed=9)
    weights, ids = select_experts(logits, 2, renormalize=True)
    ids[:5] = torch.tensor([3, 5])  # tokens sharing experts, and experts nobody picks
    tile = moe_prefill.GemmConfig(32, 32, 4, 1)
    config = moe_prefill.PrefillConfig(16, tile, tile)
    got = moe_prefill.prefill_fused_moe(x, w13, w2, weights, ids, config=config)
    assert rel(got, torch_fused_moe(x, w13, w2, weights, ids)) <= TOL[dtype]
    terms = moe_prefill.prefill_fused_moe(x, w13, w2, weights, ids, config=config, terms=True)
    assert terms.shape == (40, 2, 64) and torch.equal(terms.sum(dim=1), got)
    for slot in range(2):  # term j is slot j's expert alone, with its routing weight
        alone = torch_fused_moe(x, w13, w2, weights[:, slot:slot + 1], ids[:, slot:slot + 1])
        assert rel(terms[:, slot], alone) <= TOL[dtype]


@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_m, max_chunks",
                         [(40, 2, 8, 16, 128), (3, 8, 64, 16, 128), (300, 4, 16, 64, 128),
                          (300, 4, 16, 16, 2), (700, 2, 8, 16, 3), (600, 8, 128, 64, 128)])
def test_moe_prefill_align_equals_the_torch_align(num_tokens, top_k, num_experts, block_m,
                                                  max_chunks):
    """The three-launch align by expert: the torch align's outputs, entry for entry, padding
    and the blocks past the padded length included; few chunks make each one several tiles
    of pairs; the last case has 38 chunks of counts over 128 experts."""
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                       for _ in range(num_tokens)])
    got = moe_prefill.align_by_expert(ids, num_experts, block_m, max_chunks)
    want = torch_align_by_expert(ids, num_experts, block_m)
    assert int(got[2]) == int(want[2])
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("batch, size, width", [(3, 4, 5), (4, 4, 9), (1, 8, 300)])
def test_graph_inputs_copy_and_pad(batch, size, width):
    """A packed step (its parts where the header says, in a staging buffer longer than the
    step) into a graph's static buffers left dirty by a larger batch: its rows copied (table
    entries up to the buffers' width), rows batch..size-1 padding, the rest untouched."""
    gen = torch.Generator().manual_seed(batch + width)
    rows, max_blocks = 10, 260
    static = (torch.randint(5, 99, (rows,), generator=gen), torch.randint(5, 99, (rows,),
              generator=gen), torch.randint(5, 99, (rows,), generator=gen),
              torch.randint(5, 99, (rows,), generator=gen, dtype=torch.int32),
              torch.randint(5, 99, (rows, max_blocks), generator=gen, dtype=torch.int32))
    want = [t.clone() for t in static]
    ids, pos, slots, lens = (torch.randint(1, 1000, (batch,), generator=gen) for _ in range(4))
    tables = torch.randint(0, 1000, (batch, width), generator=gen)
    unread = torch.zeros(3, dtype=torch.int64)  # the query starts and logits indices
    parts = [ids, pos, slots, unread, lens, tables.reshape(-1), unread]
    starts = [INPUT_HEADER + sum(p.numel() for p in parts[:i]) for i in range(len(parts))]
    staged = torch.full((INPUT_HEADER + sum(p.numel() for p in parts) + 50,), 7777)
    staged[:INPUT_HEADER] = torch.tensor(input_header(batch, width, starts))
    for part, at in zip(parts, starts):
        staged[at:at + part.numel()] = part
    graph_inputs.unpack_graph_inputs(staged, static, size)
    n = min(width, max_blocks)
    for buffer, value, pad in zip(want, (ids, pos, slots, lens), (0, 0, -1, 1)):
        buffer[:batch] = value
        buffer[batch:size] = pad
    want[4][:batch, :n] = tables[:, :n]
    want[4][batch:size] = 0
    for got, expected in zip(static, want):
        assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="rows of buffers of 10"):
        graph_inputs.unpack_graph_inputs(staged, static, rows + 1)
    with pytest.raises(ValueError, match="contiguous int64 staging buffer"):
        graph_inputs.unpack_graph_inputs(staged.int(), static, size)

"""The whole-block decode split pass (cuda/decode_blocks.cu) + the Triton combine against the
torch reference.

Split counts 1-256, 2/4/8 KV heads with every built GQA group, both dtypes, block sizes 16
and 32, sliding windows (ranges starting inside a block) and sinks, more stages than blocks
and fewer (buffers refilled), empty rows and empty splits, and the engine's pair (RoPE + KV
write, then attention) in a CUDA graph with the new keys' slots NaN before each replay, so a
slot read before the PDL wait poisons the output. The caches' unwritten slots are NaN too
(gpu_paged.paged_case), so a slot past a sequence that leaks into the sums fails.
Needs sm_90+ and nvcc.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the combine, KV write and RoPE are Triton kernels")
if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

from tandem.workers.ops.attention import paged_attention_torch  # noqa: E402
from tandem.workers.ops.gpu.block_decode import (  # noqa: E402
    NewKeys, block_decode_attention, block_decode_supported, block_splits_for, new_keys_reason)
from tandem.workers.ops.gpu.kv_write import write_kv_cache  # noqa: E402
from tests.helpers.gpu_paged import (  # noqa: E402
    DEV, paged_case, paged_metadata, rel, replay_rope_write_then_attend)

_probe = torch.empty(1, 32, 128, dtype=torch.bfloat16, device=DEV)
_kv = torch.empty(1, 16, 8, 128, dtype=torch.bfloat16, device=DEV)
_why_not = block_decode_supported(_probe, _kv, _kv, 8)
if _why_not is not None:
    pytest.skip(f"block decode kernel unavailable here: {_why_not}", allow_module_level=True)

SCALE = 128 ** -0.5


def decode_case(seq_lens, heads, kv_heads, block_size, dtype, seed):
    """A decode step whose new keys are already in the cache; q for every sequence."""
    k_cache, v_cache, meta, gen = paged_case(seq_lens, [1] * len(seq_lens), kv_heads, 128,
                                             block_size, dtype, seed)
    new_k = torch.randn(len(seq_lens), kv_heads, 128, generator=gen, device=DEV).to(dtype)
    new_v = torch.randn(len(seq_lens), kv_heads, 128, generator=gen, device=DEV).to(dtype)
    write_kv_cache(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    q = torch.randn(len(seq_lens), heads, 128, generator=gen, device=DEV).to(dtype)
    return q, k_cache, v_cache, meta, gen


@pytest.mark.parametrize("num_splits", [1, 4, 33, 132, 256])
@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (16, 8), (32, 8), (64, 8), (16, 4),
                                             (8, 2)])
def test_matches_reference_across_splits_and_groups(heads, kv_heads, num_splits):
    q, k_cache, v_cache, meta, _ = decode_case([1, 17, 300, 4096], heads, kv_heads, 16,
                                               torch.bfloat16, seed=heads + num_splits)
    ref = paged_attention_torch(q, k_cache, v_cache, meta, SCALE)
    out = block_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE,
                                 num_splits=num_splits)
    assert rel(out, ref) <= 1e-2


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_buffers_refilled_when_a_split_has_more_blocks_than_stages(stages, padded):
    q, k_cache, v_cache, meta, _ = decode_case([5000, 33], 32, 8, 16, torch.bfloat16, seed=5)
    ref = paged_attention_torch(q, k_cache, v_cache, meta, SCALE)
    out = block_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE,
                                 num_splits=4, stages=stages, padded=padded)
    assert rel(out, ref) <= 1e-2


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 48, 5000])
@pytest.mark.parametrize("sinks", [False, True])
def test_windows_sinks_block_32_and_dtypes(dtype, window, sinks, padded):
    q, k_cache, v_cache, meta, gen = decode_case([2, 64, 65, 700, 2049], 32, 4, 32, dtype,
                                                 seed=7 + (window or 0))
    sink = torch.randn(32, generator=gen, device=DEV) if sinks else None
    ref = paged_attention_torch(q, k_cache, v_cache, meta, SCALE, sliding_window=window,
                                sinks=sink)
    out = block_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE,
                                 num_splits=16, sliding_window=window, sinks=sink,
                                 padded=padded)
    assert rel(out, ref) <= 1e-2


def test_empty_rows_give_zeros():
    """A padded CUDA-graph batch has seq_len 0 rows: zeros, never NaN, and no other row hurt."""
    q, k_cache, v_cache, meta, _ = decode_case([300, 5], 32, 8, 16, torch.bfloat16, seed=3)
    lens = meta.seq_lens.clone()
    lens[1] = 0
    out = block_decode_attention(q, k_cache, v_cache, meta.block_tables, lens, SCALE,
                                 num_splits=64)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = paged_attention_torch(q, k_cache, v_cache, meta, SCALE)
    assert rel(out[0], ref[0]) <= 1e-2


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("num_splits", [1, 4, 64])
def test_new_key_is_read_after_the_previous_kernel(num_splits, padded):
    """RoPE + KV write, then this kernel, replayed in a CUDA graph; the new keys' slots are
    NaN before every replay, so copying one before the PDL wait poisons the output."""
    def attend(q, k_cache, v_cache, meta, out):
        block_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE,
                               num_splits=num_splits, out=out, padded=padded)
    for out, ref, _, _ in replay_rope_write_then_attend(attend, num_splits):
        assert rel(out, ref) <= 1e-2


def test_split_count_fills_the_sms_once():
    assert block_splits_for(1, 4096, 16, 132) == 66  # a lone sequence: half the SMs
    assert block_splits_for(2, 4096, 16, 132) == 66
    assert block_splits_for(8, 4096, 16, 132) == 16
    assert block_splits_for(1, 100, 16, 132) == 7  # never more splits than blocks
    assert block_splits_for(200, 4096, 16, 132) == 1


def test_unsupported_inputs_say_why():
    assert "head_dim" in block_decode_supported(_probe[..., :64], _kv[..., :64], _kv[..., :64],
                                                8)
    assert "KV heads" in block_decode_supported(
        torch.empty(1, 24, 128, dtype=torch.bfloat16, device=DEV), _kv, _kv, 8)
    assert "split" in block_decode_supported(_probe, _kv, _kv, 300)
    assert "bf16" in block_decode_supported(_probe.float(), _kv, _kv, 8)
    strided = torch.empty(1, 16, 16, 128, dtype=torch.bfloat16, device=DEV)[:, :, :8]
    assert "contiguous" in block_decode_supported(_probe, strided, strided, 8)
    assert "multiple of 16" in block_decode_supported(_probe, _kv[:, :8], _kv[:, :8], 8)


def test_chained_calls_read_the_previous_output():
    """The combine lets the next kernel launch before its own wait (early trigger): a second
    call whose q is the first call's output, replayed in a CUDA graph, must still read the
    finished output (its loads of q come after its wait)."""
    q, k_cache, v_cache, meta, _ = decode_case([3000, 700], 32, 8, 16, torch.bfloat16, seed=11)
    first, second = torch.empty_like(q), torch.empty_like(q)

    def chain():
        first.fill_(float("nan"))
        block_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE,
                               num_splits=64, out=first)
        block_decode_attention(first, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE,
                               num_splits=64, out=second)
    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    ref_first = paged_attention_torch(q, k_cache, v_cache, meta, SCALE)
    ref_second = paged_attention_torch(first, k_cache, v_cache, meta, SCALE)
    for _ in range(5):
        graph.replay()
        assert rel(first, ref_first) <= 1e-2
        assert rel(second, ref_second) <= 1e-2


def _torch_norm_and_rope(x, weight, eps, rope, positions):
    """The reference of the fused QK norm + RoPE: norm.RMSNorm's rounding, then the torch
    RotaryEmbedding (one of q / k; the other argument is a dummy)."""
    if weight is not None:
        x32 = x.float()
        x = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return rope(positions, x, x[:, :1].clone())[0]


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("stages", [1, 3, None])
@pytest.mark.parametrize("neox, norm, dtype, heads, kv_heads", [
    (True, True, torch.bfloat16, 32, 4), (True, False, torch.bfloat16, 16, 8),
    (False, True, torch.float16, 16, 2), (False, False, torch.bfloat16, 8, 8)])
def test_new_keys_normed_rotated_and_cached_in_the_launch(neox, norm, dtype, heads, kv_heads,
                                                          stages, padded):
    """NewKeys: q raw, the new K / V rows raw; the launch norms and rotates both, writes the
    rows to their slots (nothing else in the caches changes; a padding row with slot -1 and a
    zero table row writes nothing), and attends with them, as the two-launch pair (the Triton
    RoPE + KV write, then this kernel) and the torch reference do. Few stages put the newest
    block among the refills; sequences end on block boundaries and just past them."""
    from tandem.workers.ops.backend import KernelBackend
    from tandem.workers.ops.gpu.rope import rope_and_write_kv
    from tandem.workers.ops.rotary import RotaryEmbedding
    lens = [1, 16, 17, 64, 700, 2049, 1]
    k_cache, v_cache, meta, gen = paged_case(lens, [1] * len(lens), kv_heads, 128, 16, dtype,
                                             seed=heads + 2 * kv_heads + int(neox) + 4 * int(norm))
    meta.slot_mapping[-1] = -1  # a CUDA graph's padding row (graph_inputs.py)
    meta.block_tables[-1].zero_()
    positions = meta.seq_lens.long() - 1
    params = {"rope_type": "default", "rope_theta": 10000.0}
    rope = RotaryEmbedding(128, 4096, params, backend=KernelBackend.AITER_TRITON,
                           is_neox_style=neox).to(DEV)
    torch_rope = RotaryEmbedding(128, 4096, params, is_neox_style=neox).to(DEV)
    n = len(lens)
    q, k, v = (torch.randn(n, h, 128, generator=gen, device=DEV).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    qk_norm = None
    if norm:
        qk_norm = tuple(torch.rand(128, generator=gen, device=DEV).add(0.5).to(dtype)
                        for _ in range(2)) + (1e-6,)
    new = NewKeys(k, v, positions, meta.slot_mapping, rope.cos, rope.sin, neox, qk_norm)
    assert new_keys_reason(q, new) is None
    splits = 8
    before = (k_cache.clone(), v_cache.clone())
    out = block_decode_attention(q.clone(), k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                 SCALE, num_splits=splits, stages=stages, padded=padded,
                                 new_keys=new)

    pair_k, pair_v = (c.clone() for c in before)
    q2, k2 = q.clone(), k.clone()
    rope_and_write_kv(positions, q2, k2, v, rope.cos, rope.sin, neox, pair_k, pair_v,
                      meta.slot_mapping, qk_norm)
    pair = block_decode_attention(q2, pair_k, pair_v, meta.block_tables, meta.seq_lens, SCALE,
                                  num_splits=splits, stages=stages, padded=padded)
    real = slice(0, n - 1)  # the padding row's output is dropped by the engine
    torch.testing.assert_close(k_cache, pair_k, rtol=1e-2, atol=1e-2, equal_nan=True)
    torch.testing.assert_close(v_cache, pair_v, rtol=0, atol=0, equal_nan=True)
    assert rel(out[real], pair[real]) <= 2e-3

    weights = qk_norm[:2] if norm else (None, None)
    ref_q = _torch_norm_and_rope(q, weights[0], 1e-6, torch_rope, positions)
    ref_k = _torch_norm_and_rope(k, weights[1], 1e-6, torch_rope, positions)
    slots = meta.slot_mapping[real]
    cached = k_cache.view(-1, kv_heads, 128)[slots]
    assert rel(cached, ref_k[real]) <= 1e-2
    assert torch.equal(v_cache.view(-1, kv_heads, 128)[slots], v[real])
    ref_k_cache, ref_v_cache = (c.clone() for c in before)
    write_kv_cache(ref_k[real], v[real], ref_k_cache, ref_v_cache, slots)
    ref = paged_attention_torch(ref_q[real], ref_k_cache, ref_v_cache, _first_rows(meta, n - 1),
                                SCALE)
    assert rel(out[real], ref) <= 1e-2

    untouched = torch.ones(k_cache.shape[0] * 16, dtype=torch.bool, device=DEV)
    untouched[slots] = False
    for after, old in zip((k_cache, v_cache), before):
        torch.testing.assert_close(after.view(-1, kv_heads, 128)[untouched],
                                   old.view(-1, kv_heads, 128)[untouched], rtol=0, atol=0,
                                   equal_nan=True)


def _first_rows(meta, rows):
    """The metadata of a decode step's first `rows` sequences."""
    tables = [t.tolist() for t in meta.block_tables[:rows]]
    return paged_metadata(meta.slot_mapping[:rows].tolist(), list(range(rows + 1)),
                          meta.seq_lens_host[:rows], tables, 1)


def test_new_keys_refused_where_the_launch_cannot_take_them():
    q = torch.zeros(2, 16, 128, dtype=torch.bfloat16, device=DEV)
    k = torch.zeros(2, 4, 128, dtype=torch.bfloat16, device=DEV)
    pos = torch.zeros(2, dtype=torch.int64, device=DEV)
    cos = torch.zeros(64, 64, device=DEV)
    assert new_keys_reason(q, NewKeys(k, k, pos, pos, cos, cos, True)) is None
    assert "full rotary" in new_keys_reason(q, NewKeys(k, k, pos, pos, cos[:, :32],
                                                       cos[:, :32], True))
    assert "int64" in new_keys_reason(q, NewKeys(k, k, pos.int(), pos, cos, cos, True))
    assert "dtype" in new_keys_reason(q, NewKeys(k.half(), k, pos, pos, cos, cos, True))
    assert "fp32" in new_keys_reason(q, NewKeys(k, k, pos, pos, cos.double(), cos.double(),
                                                True))
    weight = torch.ones(128, dtype=torch.float32, device=DEV)
    assert "QK-norm" in new_keys_reason(q, NewKeys(k, k, pos, pos, cos, cos, True,
                                                   (weight, weight, 1e-6)))

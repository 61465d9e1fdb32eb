"""The aiter-triton backend's kernels against the torch reference ops, on random inputs.

Attention: several batch shapes, GQA ratios, head sizes, block sizes and context lengths that
cross block boundaries; sliding windows and sinks; decode (our split-KV kernel), fresh prefill
(SDPA) and prefill over a cached context (AITER unified_attention). Outputs are poisoned
(NaN-filled caches outside the written slots) so an unwritten or misread element fails.
"""
from __future__ import annotations

import pytest
import torch

from tandem.workers.ops.aiter_compat import aiter_available

pytest.importorskip("triton", reason="the aiter-triton backend needs triton")
if not aiter_available() or not torch.cuda.is_available():
    pytest.skip("needs a GPU and amd-aiter (pip install amd-aiter)", allow_module_level=True)

from tandem.workers.ops.activation import SiluAndMul  # noqa: E402
from tandem.workers.ops.attention import (  # noqa: E402
    Attention, paged_attention_torch)
from tandem.workers.ops.backend import KernelBackend  # noqa: E402
from tandem.workers.ops.gpu.kv_write import write_kv_cache  # noqa: E402
from tandem.workers.ops.gpu.rope import rope_and_write_kv  # noqa: E402
from tandem.workers.ops.kv_cache import write_slots  # noqa: E402
from tandem.workers.ops.gpu.paged_decode import (  # noqa: E402
    num_splits_for, paged_decode_attention)
from tandem.workers.ops.norm import RMSNorm  # noqa: E402
from tandem.workers.ops.rotary import RotaryEmbedding  # noqa: E402
from tests.helpers.gpu_paged import (  # noqa: E402
    DEV, paged_case, rel, replay_rope_write_then_attend)

AITER = KernelBackend.AITER_TRITON
BF16_REL = 1e-2
FP32_REL = 1e-5


ATTENTION_CASES = [
    # seq_lens, query_lens, heads, kv_heads, head_dim, block_size
    ([1, 17, 300, 4096], [1, 1, 1, 1], 32, 8, 128, 16),  # decode, GQA 4
    ([33, 1000], [1, 1], 8, 8, 64, 32),  # decode, MHA
    ([129, 2], [1, 1], 16, 2, 128, 16),  # decode, GQA 8
    ([40, 77], [40, 77], 32, 8, 128, 16),  # fresh prefill
    ([40, 300, 9], [7, 100, 1], 32, 8, 128, 16),  # prefill over cached context + a decode
    ([64, 65], [64, 30], 8, 4, 64, 32),  # prefix hit ending on a block boundary
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 48])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_matches_reference(case, sinks, window, dtype):
    seq_lens, query_lens, heads, kv_heads, head_dim, block_size = case
    k_cache, v_cache, meta, gen = paged_case(seq_lens, query_lens, kv_heads, head_dim,
                                             block_size, dtype, seed=sum(seq_lens))
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, head_dim, generator=gen, device=DEV).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen, device=DEV).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen, device=DEV).to(dtype)
    layers = {}
    for backend in (KernelBackend.TORCH, AITER):
        layer = Attention(heads, head_dim, head_dim ** -0.5, kv_heads, backend,
                          sliding_window=window, has_sinks=sinks).to(DEV)
        if sinks:
            layer.sinks.data = torch.randn(heads, generator=gen, device=DEV)
        layer.bind_kv_cache(k_cache.clone(), v_cache.clone())
        layers[backend] = layer
    layers[AITER].sinks = layers[KernelBackend.TORCH].sinks
    ref = layers[KernelBackend.TORCH](q, k, v, meta)
    out = layers[AITER](q, k, v, meta)
    assert rel(out, ref) <= (BF16_REL if dtype == torch.bfloat16 else FP32_REL)
    # the KV write landed in the same slots, bit for bit
    assert torch.equal(layers[AITER].k_cache.nan_to_num(7.0),
                       layers[KernelBackend.TORCH].k_cache.nan_to_num(7.0))


@pytest.mark.parametrize("seq_lens", [[2048], [300, 4096, 17]])
def test_fresh_prefill_reads_kv_heads_in_kernel(seq_lens):
    """At bf16 GQA shapes (Qwen3's 32 / 4 heads) fresh prefill reads the K/V heads as they are
    (flash or cuDNN with enable_gqa, no repeated copy), and agrees with the repeated form."""
    from tandem.workers.ops.attention_gpu import _fresh_prefill_sdpa, _sdpa_takes_gqa
    _, _, meta, gen = paged_case(seq_lens, seq_lens, 4, 128, 16, torch.bfloat16, seed=5)
    q, k, v = (torch.randn(sum(seq_lens), h, 128, generator=gen, device=DEV).bfloat16()
               for h in (32, 4, 4))
    assert _sdpa_takes_gqa(q[:seq_lens[0]].transpose(0, 1)[None],
                           k[:seq_lens[0]].transpose(0, 1)[None])
    out = _fresh_prefill_sdpa(q, k, v, meta, 128 ** -0.5, None)
    repeated = _fresh_prefill_sdpa(q, k, v, meta, 128 ** -0.5, None, gqa_in_kernel=False)
    assert rel(out, repeated) <= BF16_REL


@pytest.mark.parametrize("num_splits", [1, 2, 8, 64])
def test_split_counts_agree(num_splits):
    k_cache, v_cache, meta, gen = paged_case([5, 700, 2049], [1, 1, 1], 4, 128, 16,
                                             torch.bfloat16, seed=num_splits)
    q = torch.randn(3, 16, 128, generator=gen, device=DEV).to(torch.bfloat16)
    k_cache.nan_to_num_(0.0)  # this case writes nothing: the slots of the new token hold 0
    v_cache.nan_to_num_(0.0)
    ref = paged_attention_torch(q, k_cache, v_cache, meta, 128 ** -0.5)
    out = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                 128 ** -0.5, num_splits=num_splits)
    assert rel(out, ref) <= BF16_REL


@pytest.mark.parametrize("num_splits, block_n", [(1, 64), (8, 32), (64, 64)])
def test_prefetched_tile_waits_for_the_new_key(num_splits, block_n):
    """prefetch=True loads the first tile before the PDL wait, all but the newest key. Replay
    the engine's pair (RoPE + KV write, then decode attention) back to back in a CUDA graph,
    the new keys' slots NaN before each replay: reading one early would poison the output."""
    def attend(q, k_cache, v_cache, meta, out):
        paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                               128 ** -0.5, num_splits=num_splits, block_n=block_n,
                               prefetch=True, out=out)
    for out, ref, new_k, ref_k in replay_rope_write_then_attend(attend, num_splits + block_n):
        assert rel(new_k, ref_k) <= BF16_REL
        assert rel(out, ref) <= BF16_REL


def test_split_count_choice():
    assert num_splits_for(1, 8, 4096, 132) == 32  # batch 1 fills ~2 waves of SMs
    assert num_splits_for(64, 8, 4096, 132) == 1  # batch 64 already does
    assert num_splits_for(1, 8, 100, 132) == 2  # never a split shorter than a 64-key tile
    assert num_splits_for(1, 8, 64, 132) == 1


def test_kv_write_skips_padding_slots():
    cache = torch.zeros(4, 16, 2, 64, device=DEV)
    k = torch.randn(3, 2, 64, device=DEV)
    write_kv_cache(k, k, cache, cache.clone(), torch.tensor([5, -1, 40], device=DEV))
    flat = cache.view(-1, 2, 64)
    assert torch.equal(flat[5], k[0]) and torch.equal(flat[40], k[2])
    flat[5] = 0.0
    flat[40] = 0.0
    assert not flat.any()  # nothing else written (an exact check, unlike comparing fp32 sums)


def test_block_major_caches_write_and_read_like_contiguous_ones():
    """The runner's block-major layout ([blocks, tensors, block], tensor i = stack[:, i]): the
    KV write and the RoPE + KV write land each row where the torch reference (write_slots)
    puts it, touch no other tensor of the stack, and decode attention over the strided caches
    equals attention over contiguous copies, bit for bit."""
    blocks, block_size, heads, kv_heads, dim = 40, 16, 8, 2, 64
    stack = torch.zeros(blocks, 4, block_size, kv_heads, dim, device=DEV, dtype=torch.bfloat16)
    k_cache, v_cache = stack[:, 1], stack[:, 2]
    slots = torch.randperm(blocks * block_size, device=DEV)[:50]
    k = torch.randn(50, kv_heads, dim, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    write_kv_cache(k, v, k_cache, v_cache, slots.int())
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    write_slots(want_k, slots, k)
    write_slots(want_v, slots, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert not stack[:, 0].any() and not stack[:, 3].any()
    rope = RotaryEmbedding(dim, 4096, {"rope_type": "default", "rope_theta": 10000.0},
                           backend=AITER).to(DEV)
    q = torch.randn(50, heads, dim, device=DEV, dtype=torch.bfloat16)
    positions = torch.randint(0, 4096, (50,), device=DEV)
    stack.zero_()
    q_ref, k_ref = rope(positions, q.clone(), k.clone())
    rope_and_write_kv(positions, q, k, v, rope.cos, rope.sin, rope.is_neox_style, k_cache,
                      v_cache, slots.int())
    write_slots(want_k.zero_(), slots, k_ref)
    assert torch.equal(q, q_ref) and torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v) and not stack[:, 0].any() and not stack[:, 3].any()
    stack.normal_()
    tables = torch.randperm(blocks, device=DEV).view(2, 20).int()
    seq_lens = torch.tensor([300, 77], device=DEV, dtype=torch.int32)
    q1 = torch.randn(2, heads, dim, device=DEV, dtype=torch.bfloat16)
    got = paged_decode_attention(q1, k_cache, v_cache, tables, seq_lens, dim ** -0.5,
                                 num_splits=4)
    ref = paged_decode_attention(q1, k_cache.contiguous(), v_cache.contiguous(), tables,
                                 seq_lens, dim ** -0.5, num_splits=4)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("neox, partial", [(True, 1.0), (False, 1.0), (True, 0.5)])
def test_rope_matches_reference(neox, partial, dtype):
    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}
    ref_op = RotaryEmbedding(128, 4096, params, is_neox_style=neox).to(DEV)
    op = RotaryEmbedding(128, 4096, params, backend=AITER, is_neox_style=neox).to(DEV)
    qkv = torch.randn(300, (32 + 8 + 8) * 128, device=DEV).to(dtype)
    q, k = qkv[:, :4096].view(300, 32, 128), qkv[:, 4096:5120].view(300, 8, 128)
    positions = torch.randint(0, 4096, (300,), device=DEV)
    ref_q, ref_k = ref_op(positions, q.clone(), k.clone())
    out_q, out_k = op(positions, q, k)
    tol = BF16_REL if dtype == torch.bfloat16 else FP32_REL
    assert rel(out_q, ref_q) <= tol and rel(out_k, ref_k) <= tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, cols", [(1, 4096), (37, 5120), (2048, 2880)])
def test_rms_norm_and_silu_match_reference(rows, cols, dtype):
    ref_op, op = RMSNorm(cols, 1e-5).to(DEV, dtype), RMSNorm(cols, 1e-5, AITER).to(DEV, dtype)
    weight = torch.rand(cols, device=DEV).to(dtype) + 0.5
    ref_op.weight.data, op.weight.data = weight.clone(), weight.clone()
    x = torch.randn(rows, cols, device=DEV).to(dtype)
    residual = torch.randn(rows, cols, device=DEV).to(dtype)
    tol = BF16_REL if dtype == torch.bfloat16 else FP32_REL
    assert rel(op(x), ref_op(x)) <= tol
    ref_out, ref_sum = ref_op(x, residual.clone())
    out, summed = op(x, residual.clone())
    assert rel(out, ref_out) <= tol and rel(summed, ref_sum) <= tol
    gate_up = torch.randn(rows, 2 * cols, device=DEV).to(dtype)
    assert rel(SiluAndMul(AITER)(gate_up), SiluAndMul()(gate_up)) <= tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens, terms, cols", [(1, 8, 2048), (300, 8, 2048), (37, 2, 4096),
                                                 (129, 6, 2880)])
def test_rms_norm_adds_expert_terms_first(tokens, terms, cols, dtype):
    """x [T, n, D] with a residual (a MoE layer's unsummed expert outputs): summed, added,
    normed in one kernel, as the torch module sums them first."""
    ref_op, op = RMSNorm(cols, 1e-6).to(DEV, dtype), RMSNorm(cols, 1e-6, AITER).to(DEV, dtype)
    weight = torch.rand(cols, device=DEV).to(dtype) + 0.5
    ref_op.weight.data, op.weight.data = weight.clone(), weight.clone()
    x = torch.randn(tokens, terms, cols, device=DEV).to(dtype) / terms
    residual = torch.randn(tokens, cols, device=DEV).to(dtype)
    ref_out, ref_sum = ref_op(x, residual.clone())
    out, summed = op(x, residual.clone())
    tol = BF16_REL if dtype == torch.bfloat16 else FP32_REL
    assert out.shape == summed.shape == (tokens, cols)
    assert rel(out, ref_out) <= tol and rel(summed, ref_sum) <= tol
    # Their sum as one fp32 row (decode_moe(fp32_sum=True)): rounded to the residual's dtype
    # first, the same outputs as for that rounded row.
    x32 = x.float().sum(1)
    got32, want32 = residual.clone(), residual.clone()
    out32 = op(x32, got32)[0]
    assert out32.dtype == dtype and torch.equal(out32, op(x32.to(dtype), want32)[0])
    assert torch.equal(got32, want32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens, heads, head_dim", [(1, 32, 128), (300, 4, 128),
                                                     (8192, 32, 128), (33, 5, 96)])
@pytest.mark.parametrize("strided", [False, True])
def test_per_head_rms_norm_matches_reference(tokens, heads, head_dim, strided, dtype):
    """Qwen3's QK norm: [T, H, D] rows of head_dim, strided as q out of a fused qkv row."""
    ref_op = RMSNorm(head_dim, 1e-6).to(DEV, dtype)
    op = RMSNorm(head_dim, 1e-6, AITER).to(DEV, dtype)
    weight = torch.rand(head_dim, device=DEV).to(dtype) + 0.5
    ref_op.weight.data, op.weight.data = weight.clone(), weight.clone()
    if strided:
        qkv = torch.randn(tokens, (heads + 3) * head_dim, device=DEV).to(dtype)
        x = qkv[:, head_dim:(heads + 1) * head_dim].view(tokens, heads, head_dim)
    else:
        x = torch.randn(tokens, heads, head_dim, device=DEV).to(dtype)
    out = op(x)
    assert out.shape == x.shape and out.is_contiguous()
    assert rel(out, ref_op(x)) <= (BF16_REL if dtype == torch.bfloat16 else FP32_REL)

"""The small-batch fused kernels against the unfused torch ops they replace.

fused_gemv (add + RMSNorm + projection, SiLU*mul for gate_up) for one row at Llama-8B-like
and ragged shapes, and with the normed row kept (a MoE router beside its experts);
rope_and_write_kv against RotaryEmbedding + write_kv_cache (neox, GPT-J, partial rotary,
padding slots that must write nothing), and with Qwen3's QK norm in the same launch.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.workers.ops.aiter_compat import aiter_available

pytest.importorskip("triton", reason="the aiter-triton backend needs triton")
if not aiter_available() or not torch.cuda.is_available():
    pytest.skip("needs a GPU and amd-aiter (pip install amd-aiter)", allow_module_level=True)

from tandem.workers.ops.attention import write_kv_cache  # noqa: E402
from tandem.workers.ops.gpu.decode_gemv import fused_gemv  # noqa: E402
from tandem.workers.ops.gpu.rope import rope_and_write_kv  # noqa: E402
from tandem.workers.ops.kv_cache import write_slots  # noqa: E402
from tandem.workers.ops.norm import RMSNorm  # noqa: E402
from tandem.workers.ops.rotary import RotaryEmbedding  # noqa: E402

DEV = "cuda"


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def unfused(x, weight, residual, norm_weight, silu_mul):
    new_residual = None
    if residual is not None:
        x = new_residual = x + residual
    if norm_weight is not None:
        norm = RMSNorm(x.shape[1], 1e-5).to(DEV, x.dtype)
        norm.weight.data.copy_(norm_weight)
        x = norm(x)
    y = F.linear(x, weight)
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y, new_residual


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k, silu_mul", [(6144, 4096, False), (28672, 4096, True),
                                            (4096, 14336, False), (200, 328, True),
                                            (77, 96, False), (5120, 2048, False),
                                            (2048, 4096, False), (128, 2048, False)])
@pytest.mark.parametrize("fuse_norm", [False, True])
def test_fused_gemv_matches_unfused_ops(n, k, silu_mul, fuse_norm, dtype):
    rows = 1
    gen = torch.Generator(device=DEV).manual_seed(n + k)
    x = torch.randn(rows, k, generator=gen, device=DEV).to(dtype)
    weight = (torch.randn(n, k, generator=gen, device=DEV) / k ** 0.5).to(dtype)
    residual = torch.randn(rows, k, generator=gen, device=DEV).to(dtype) if fuse_norm else None
    norm_weight = (torch.rand(k, generator=gen, device=DEV) + 0.5).to(dtype) \
        if fuse_norm else None
    ref, ref_residual = unfused(x, weight, residual, norm_weight, silu_mul)
    out, new_residual = fused_gemv(x, weight, residual=residual, norm_weight=norm_weight,
                                   eps=1e-5, silu_mul=silu_mul)
    assert out.shape == ref.shape
    assert rel(out, ref) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)
    if fuse_norm:
        assert torch.equal(new_residual, ref_residual)  # the residual add is exact
        # x as an fp32 row (a MoE layer's sum, decode_moe(fp32_sum=True)): rounded to the
        # residual's dtype first, so the outputs equal those for that rounded row.
        x32 = x.float() + torch.randn(rows, k, generator=gen, device=DEV) * 1e-3
        out32, residual32 = fused_gemv(x32, weight, residual=residual, norm_weight=norm_weight,
                                       eps=1e-5, silu_mul=silu_mul)
        want32, want_residual32 = fused_gemv(x32.to(dtype), weight, residual=residual,
                                             norm_weight=norm_weight, eps=1e-5,
                                             silu_mul=silu_mul)
        assert out32.dtype == dtype and torch.equal(residual32, want_residual32)
        assert torch.equal(out32, want32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k", [(128, 2048), (8, 4096), (77, 96)])
def test_fused_gemv_keeps_the_normed_row(n, k, dtype):
    """normed_out (small_batch.norm_router: a MoE router and the experts' input in one
    launch): the normed row equals RMSNorm's output (bit for bit in bf16; in fp32 within
    rounding, as the two kernels add the squares in different orders), the residual sum is
    exact and the logits match the unfused ops as without it."""
    gen = torch.Generator(device=DEV).manual_seed(n * k)
    x = torch.randn(1, k, generator=gen, device=DEV).to(dtype)
    residual = torch.randn(1, k, generator=gen, device=DEV).to(dtype)
    weight = (torch.randn(n, k, generator=gen, device=DEV) / k ** 0.5).to(dtype)
    norm = RMSNorm(k, 1e-6).to(DEV, dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    with torch.no_grad():
        ref_normed, ref_residual = norm(x, residual.clone())
    normed = torch.full_like(x, float("nan"))
    out, new_residual = fused_gemv(x, weight, residual=residual, norm_weight=norm.weight,
                                   eps=1e-6, normed_out=normed)
    assert torch.equal(new_residual, ref_residual)
    if dtype == torch.bfloat16:
        assert torch.equal(normed, ref_normed)
    else:
        assert rel(normed, ref_normed) <= 1e-6
    assert rel(out, F.linear(ref_normed, weight)) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("neox, partial", [(True, 1.0), (False, 1.0), (True, 0.5)])
def test_rope_and_write_kv_matches_separate_ops(neox, partial, dtype):
    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}
    rope = RotaryEmbedding(128, 4096, params, is_neox_style=neox).to(DEV)
    tokens = 37
    qkv = torch.randn(tokens, (32 + 8 + 8) * 128, device=DEV).to(dtype)
    q, k, v = (t.view(tokens, -1, 128) for t in qkv.split([4096, 1024, 1024], dim=-1))
    positions = torch.randint(0, 4096, (tokens,), device=DEV)
    slots = torch.randperm(64 * 16, device=DEV)[:tokens]
    slots[3] = -1  # a CUDA-graph padding row: writes nothing
    caches = [torch.full((64, 16, 8, 128), float("nan"), device=DEV, dtype=dtype)
              for _ in range(4)]
    ref_q, ref_k = rope(positions, q.clone(), k.clone())
    real = slots >= 0
    write_kv_cache(ref_k[real], v[real], caches[0], caches[1], slots[real])
    rope_and_write_kv(positions, q, k, v, rope.cos, rope.sin, neox, caches[2], caches[3], slots)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel(q, ref_q) <= tol and rel(k, ref_k) <= tol
    for ours, ref in ((caches[2], caches[0]), (caches[3], caches[1])):
        assert torch.equal(ours.isnan(), ref.isnan())  # the same slots written, no others
        assert rel(ours.nan_to_num(0.0), ref.nan_to_num(0.0)) <= tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("neox", [True, False])
def test_rope_with_fused_qk_norm_matches_norm_then_rope(neox, dtype):
    """rope_and_write_kv with qk_norm (Qwen3's per-head RMSNorm in the same launch) on q and k
    viewed out of one qkv tensor: q, k and the cached rows equal RMSNorm -> RoPE -> cache
    write in torch; v is cached bit for bit and a padding slot writes nothing."""
    tokens, heads, kv_heads, dim, blocks, block_size = 300, 32, 8, 128, 40, 16
    params = {"rope_type": "default", "rope_theta": 10000.0}
    rope = RotaryEmbedding(dim, 4096, params, is_neox_style=neox).to(DEV)
    norms = [RMSNorm(dim, 1e-6).to(DEV, dtype) for _ in range(2)]
    for norm in norms:
        norm.weight.data.uniform_(0.5, 1.5)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEV) * 3).to(dtype)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    positions = torch.randint(0, 4096, (tokens,), device=DEV)
    slots = torch.randperm(blocks * block_size, device=DEV)[:tokens]
    slots[7] = -1
    stack = torch.zeros(blocks, 2, block_size, kv_heads, dim, device=DEV, dtype=dtype)
    k_cache, v_cache = stack[:, 0], stack[:, 1]
    with torch.no_grad():
        ref_q, ref_k = rope(positions, norms[0](q.clone()), norms[1](k.clone()))
    keep = slots >= 0
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    write_slots(want_k, slots[keep], ref_k[keep])
    write_slots(want_v, slots[keep], v[keep])
    rope_and_write_kv(positions, q, k, v, rope.cos, rope.sin, neox, k_cache, v_cache,
                      slots, (norms[0].weight, norms[1].weight, 1e-6))
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel(q, ref_q) <= tol and rel(k, ref_k) <= tol and rel(k_cache, want_k) <= tol
    assert torch.equal(v_cache, want_v)

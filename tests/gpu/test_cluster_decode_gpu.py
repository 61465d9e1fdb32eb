"""The single-launch cluster decode kernel (cuda/decode_cluster.cu) against the torch reference.

Splits 1-16 (the cluster size), every built GQA group, both dtypes, block sizes 16 and 32,
sliding windows and sinks, empty splits (short sequences, many splits), and the engine's pair
(RoPE + KV write, then attention) replayed in a CUDA graph with the new keys' slots NaN before
each replay, so a key read before the PDL wait poisons the output. Needs sm_90+ and nvcc.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the reference KV write and RoPE are Triton kernels")
if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

from tandem.workers.ops.attention import paged_attention_torch  # noqa: E402
from tandem.workers.ops.gpu.cluster_decode import (  # noqa: E402
    SHAPES, cluster_decode_attention, cluster_decode_supported)
from tandem.workers.ops.gpu.kv_cache import write_kv_cache  # noqa: E402
from tests.helpers.gpu_paged import (  # noqa: E402
    DEV, paged_case, rel, replay_rope_write_then_attend)

_probe = torch.empty(1, 8, 128, dtype=torch.bfloat16, device=DEV)
_why_not = cluster_decode_supported(_probe, torch.empty(1, 16, 1, 128, dtype=torch.bfloat16,
                                                        device=DEV), 16)
if _why_not is not None:
    pytest.skip(f"cluster decode kernel unavailable here: {_why_not}", allow_module_level=True)

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


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_splits", [1, 2, 8, 16])
@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (16, 8), (32, 8), (64, 8)])
def test_matches_reference_across_splits_and_groups(heads, kv_heads, num_splits, shape):
    q, k_cache, v_cache, meta, _ = decode_case([1, 17, 300, 4096], heads, kv_heads, 16,
                                               torch.bfloat16, seed=heads + num_splits)
    ref = paged_attention_torch(q, k_cache, v_cache, meta, SCALE)
    out = cluster_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                   SCALE, num_splits=num_splits, shape=shape)
    assert rel(out, ref) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 48, 5000])
@pytest.mark.parametrize("sinks", [False, True])
def test_windows_sinks_and_dtypes(dtype, window, sinks):
    q, k_cache, v_cache, meta, gen = decode_case([2, 64, 65, 700, 2049], 32, 4, 32, dtype,
                                                 seed=7 + (window or 0))
    sink = torch.randn(32, generator=gen, device=DEV) if sinks else None
    ref = paged_attention_torch(q, k_cache, v_cache, meta, SCALE, sliding_window=window,
                                sinks=sink)
    out = cluster_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                   SCALE, num_splits=16, sliding_window=window, sinks=sink)
    assert rel(out, ref) <= 1e-2


def test_empty_rows_give_zeros():
    """A padded CUDA-graph batch has seq_len 0 rows: zeros, never NaN, and no other row hurt."""
    q, k_cache, v_cache, meta, _ = decode_case([300, 5], 32, 8, 16, torch.bfloat16, seed=3)
    lens = meta.seq_lens.clone()
    lens[1] = 0
    out = cluster_decode_attention(q, k_cache, v_cache, meta.block_tables, lens, SCALE,
                                   num_splits=8)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = paged_attention_torch(q, k_cache, v_cache, meta, SCALE)
    assert rel(out[0], ref[0]) <= 1e-2


@pytest.mark.parametrize("num_splits", [1, 4, 16])
def test_new_key_is_read_after_the_previous_kernel(num_splits):
    """RoPE + KV write, then this kernel, replayed in a CUDA graph; the new keys' slots are
    NaN before every replay, so loading one before the PDL wait poisons the output."""
    def attend(q, k_cache, v_cache, meta, out):
        cluster_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, SCALE,
                                 num_splits=num_splits, out=out)
    for out, ref, _, _ in replay_rope_write_then_attend(attend, num_splits):
        assert rel(out, ref) <= 1e-2


def test_unsupported_inputs_say_why():
    kv = torch.empty(1, 16, 8, 128, dtype=torch.bfloat16, device=DEV)
    assert "head_dim" in cluster_decode_supported(
        torch.empty(1, 8, 64, dtype=torch.bfloat16, device=DEV), kv[..., :64], 8)
    assert "query heads" in cluster_decode_supported(
        torch.empty(1, 24, 128, dtype=torch.bfloat16, device=DEV), kv, 8)
    assert "split" in cluster_decode_supported(_probe, kv, 32)
    assert "bf16" in cluster_decode_supported(_probe.float(), kv, 8)

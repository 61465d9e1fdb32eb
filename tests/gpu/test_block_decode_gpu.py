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
    block_decode_attention, block_decode_supported, block_splits_for)
from tandem.workers.ops.gpu.kv_write import write_kv_cache  # noqa: E402
from tests.helpers.gpu_paged import (  # noqa: E402
    DEV, paged_case, rel, replay_rope_write_then_attend)

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

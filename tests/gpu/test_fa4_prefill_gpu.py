"""Fresh-prefill attention through FlashAttention-4 (ops/gpu/fa4_prefill.py) against the fp32
reference, which steps take it, and an engine whose prefills run on it (Hopper with
flash-attn-4 installed; skipped elsewhere)."""
from __future__ import annotations

import itertools

import pytest
import torch
from helpers.checkpoints import random_prompts

from tandem import LLM, SamplingParams
from tandem.workers.ops import attention_gpu, kernel_options
from tandem.workers.ops.gpu import fa4_prefill
from tandem.workers.ops.kernel_options import KernelOptions


def _fa4_or_skip():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FA4's Hopper kernel needs compute capability 9.x")
    if fa4_prefill._forward() is None:
        pytest.skip("flash-attn-4 is not installed")


def _qkv(lens, heads, kv_heads, dim, dtype, seed):
    """q, k, v as the engine has them: strided views of one [T, (H + 2 KVH) * D] projection."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lens)
    qkv = torch.randn(total, (heads + 2 * kv_heads) * dim, device="cuda", dtype=dtype,
                      generator=g)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return q.view(total, heads, dim), k.view(total, kv_heads, dim), v.view(total, kv_heads, dim)


def _reference(q, k, v, lens, scale):
    """Causal attention per sequence in fp32, GQA heads repeated."""
    group = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in lens:
        qs, ks, vs = (x[start:start + n].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        scores = (qs @ ks.transpose(1, 2)) * scale
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        out.append((scores.masked_fill(mask, float("-inf")).softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("lens,heads,kv_heads,dim,dtype", [
    ([4096], 32, 4, 128, torch.bfloat16),           # a lone long prompt, GQA 8
    ([37, 300, 1, 129, 16], 8, 2, 128, torch.bfloat16),  # several prompts, one of one token
    ([100, 260], 4, 4, 64, torch.float16),           # MHA, head dim 64 (FA4's own tiles)
    ([5, 77, 512], 16, 2, 96, torch.bfloat16),       # head dim 96
])
def test_fa4_prefill_matches_the_fp32_reference(lens, heads, kv_heads, dim, dtype):
    _fa4_or_skip()
    q, k, v = _qkv(lens, heads, kv_heads, dim, dtype, seed=sum(lens))
    scale = dim ** -0.5
    cu = torch.tensor([0, *itertools.accumulate(lens)], device="cuda", dtype=torch.int32)
    got = fa4_prefill.fa4_prefill_attention(q, k, v, cu, max(lens), scale)
    want = _reference(q, k, v, lens, scale)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_which_fresh_prefills_take_fa4():
    _fa4_or_skip()
    q, k, _ = _qkv([8], 8, 2, 128, torch.bfloat16, seed=0)
    long = fa4_prefill.LONE_MIN_TOKENS
    assert fa4_prefill.fa4_takes(q, k, num_seqs=2, num_tokens=8, sliding_window=None)
    assert fa4_prefill.fa4_takes(q, k, num_seqs=1, num_tokens=long, sliding_window=None)
    assert not fa4_prefill.fa4_takes(q, k, num_seqs=1, num_tokens=long - 1,
                                     sliding_window=None)
    assert not fa4_prefill.fa4_takes(q, k, num_seqs=2, num_tokens=8, sliding_window=4)
    assert not fa4_prefill.fa4_takes(q.float(), k.float(), num_seqs=2, num_tokens=8,
                                     sliding_window=None)
    installed = kernel_options.current()
    try:
        kernel_options.install(KernelOptions(fa4_prefill=False))
        fa4_prefill._device_takes.cache_clear()
        assert not fa4_prefill.fa4_takes(q, k, num_seqs=2, num_tokens=8, sliding_window=None)
    finally:
        kernel_options.install(installed)
        fa4_prefill._device_takes.cache_clear()


def test_engine_prefills_on_fa4_follow_the_fp32_reference(checkpoint, monkeypatch):
    """Several prompts prefilled in one step take FA4; the bf16 greedy tokens equal fp32
    transformers' wherever its top-1 is decided (test_engine_on_gpu's check)."""
    _fa4_or_skip()
    from tandem.workers.ops.aiter_compat import aiter_available
    if not aiter_available():
        pytest.skip("amd-aiter is not installed")
    from test_engine_on_gpu import _assert_greedy_where_decided

    calls = []
    original = attention_gpu.fa4_prefill_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(attention_gpu, "fa4_prefill_attention", counted)
    ckpt = checkpoint("qwen3_h128")
    prompts = random_prompts([9, 40, 130, 300, 77], seed=35)
    llm = LLM(ckpt.path, dtype="bfloat16", device="cuda", kernels="aiter-triton",
              enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    decided = [_assert_greedy_where_decided(ckpt, prompt, out.token_ids)
               for prompt, out in zip(prompts, llm.generate(prompts, greedy))]
    assert calls, "no prefill step took FA4"
    assert sum(decided) >= len(decided) * 8, decided
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks

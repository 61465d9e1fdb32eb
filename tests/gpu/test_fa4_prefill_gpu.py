"""Prefill attention through FlashAttention-4 (ops/gpu/fa4_prefill.py), fresh and over a paged
cache, against the fp32 reference; which steps take it; engines whose prefills run on it
(Hopper with flash-attn-4 installed; skipped elsewhere)."""
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


@pytest.mark.parametrize("new,cached,heads,kv_heads,dim", [
    ([2000], [600], 32, 4, 128),                 # a prompt over its cached prefix
    ([300, 37, 512, 1], [100, 3000, 0, 40], 8, 2, 128),  # continuing, fresh and one token
    ([256, 128], [1024, 17], 4, 4, 64),
])
def test_fa4_paged_prefill_matches_the_fp32_reference(new, cached, heads, kv_heads, dim):
    """Each sequence's new tokens attend causally over its cached keys and its own, read
    from a block-16 cache through scattered block tables. K and V are views of one
    block-major allocation, as the engine's are (engine/model_runner.py)."""
    _fa4_or_skip()
    from tandem.workers.ops.attention import AttentionMetadata

    block, dtype = 16, torch.bfloat16
    lens = [n + c for n, c in zip(new, cached)]
    blocks = [-(-n // block) for n in lens]
    g = torch.Generator(device="cuda").manual_seed(sum(lens))
    num_blocks = sum(blocks) + 8
    stack = torch.randn(num_blocks, 3, block, kv_heads, dim, device="cuda", dtype=dtype,
                        generator=g)  # another layer's K beside this one's K and V
    k_cache, v_cache = stack[:, 1], stack[:, 2]
    assert fa4_prefill._pages_in_place(k_cache) and not k_cache.is_contiguous()
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    tables = torch.zeros(len(new), max(blocks), dtype=torch.int32)
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor(order[sum(blocks[:i]):sum(blocks[:i + 1])])
    q = torch.randn(sum(new), heads, dim, device="cuda", dtype=dtype, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(new), dtype=torch.int64, device="cuda"),
        query_start_loc=torch.tensor([0, *itertools.accumulate(new)], dtype=torch.int32,
                                     device="cuda"),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
        block_tables=tables.cuda(), max_query_len=max(new), max_seq_len=max(lens),
        query_start_loc_host=[0, *itertools.accumulate(new)], seq_lens_host=lens)
    scale = dim ** -0.5
    got = fa4_prefill.fa4_paged_prefill_attention(q, k_cache, v_cache, meta, scale)
    group, want, start = heads // kv_heads, [], 0
    for i, (n, total) in enumerate(zip(new, lens)):
        rows = tables[i, :blocks[i]].cuda().long()
        keys, values = (c[rows].reshape(-1, kv_heads, dim)[:total].float().transpose(0, 1)
                        .repeat_interleave(group, 0) for c in (k_cache, v_cache))
        qs = q[start:start + n].float().transpose(0, 1)
        scores = (qs @ keys.transpose(1, 2)) * scale
        future = torch.arange(total, device="cuda")[None, :] > \
            (total - n + torch.arange(n, device="cuda"))[:, None]
        want.append((scores.masked_fill(future, float("-inf")).softmax(-1) @ values)
                    .transpose(0, 1))
        start += n
    torch.testing.assert_close(got.float(), torch.cat(want), atol=2e-2, rtol=2e-2)


def test_which_prefills_take_fa4():
    _fa4_or_skip()
    q, k, _ = _qkv([8], 8, 2, 128, torch.bfloat16, seed=0)
    cache = torch.zeros(4, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    long, paged = fa4_prefill.LONE_MIN_TOKENS, fa4_prefill.PAGED_MIN_TOKENS
    assert fa4_prefill.fa4_takes_fresh(q, k, num_seqs=2, num_tokens=8, sliding_window=None)
    assert fa4_prefill.fa4_takes_fresh(q, k, num_seqs=1, num_tokens=long, sliding_window=None)
    assert not fa4_prefill.fa4_takes_fresh(q, k, num_seqs=1, num_tokens=long - 1,
                                           sliding_window=None)
    assert not fa4_prefill.fa4_takes_fresh(q, k, num_seqs=2, num_tokens=8, sliding_window=4)
    assert not fa4_prefill.fa4_takes_fresh(q.float(), k.float(), num_seqs=2, num_tokens=8,
                                           sliding_window=None)
    assert fa4_prefill.fa4_takes_paged(q, cache, num_tokens=paged, sliding_window=None)
    assert not fa4_prefill.fa4_takes_paged(q, cache, num_tokens=paged - 1, sliding_window=None)
    assert not fa4_prefill.fa4_takes_paged(q, cache, num_tokens=paged, sliding_window=64)
    head_major = cache.transpose(1, 2).contiguous().transpose(1, 2)  # FA4 would copy it
    assert not fa4_prefill.fa4_takes_paged(q, head_major, num_tokens=paged, sliding_window=None)
    installed = kernel_options.current()
    try:
        kernel_options.install(KernelOptions(fa4_prefill=False))
        fa4_prefill._device_takes.cache_clear()
        assert not fa4_prefill.fa4_takes_fresh(q, k, num_seqs=2, num_tokens=8,
                                               sliding_window=None)
        assert not fa4_prefill.fa4_takes_paged(q, cache, num_tokens=paged, sliding_window=None)
    finally:
        kernel_options.install(installed)
        fa4_prefill._device_takes.cache_clear()


def _count_calls(monkeypatch, name: str) -> list[int]:
    """Wraps attention_gpu's `name` to record each call's token count."""
    calls, original = [], getattr(attention_gpu, name)

    def counted(q, *args, **kwargs):
        calls.append(q.shape[0])
        return original(q, *args, **kwargs)

    monkeypatch.setattr(attention_gpu, name, counted)
    return calls


def test_engine_prefills_on_fa4_follow_the_fp32_reference(checkpoint, monkeypatch):
    """Several prompts prefilled in one step take FA4, and so do long prompts prefilled in
    chunks and, on a second pass, over their cached prefixes; the bf16 greedy tokens equal fp32
    transformers' wherever its top-1 is decided (test_engine_on_gpu's check)."""
    _fa4_or_skip()
    from tandem.workers.ops.aiter_compat import aiter_available
    if not aiter_available():
        pytest.skip("amd-aiter is not installed")
    from test_engine_on_gpu import _assert_greedy_where_decided

    fresh = _count_calls(monkeypatch, "fa4_prefill_attention")
    paged = _count_calls(monkeypatch, "fa4_paged_prefill_attention")
    ckpt = checkpoint("qwen3_h128")
    greedy = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    llm = LLM(ckpt.path, dtype="bfloat16", device="cuda", kernels="aiter-triton",
              enable_prefix_caching=False)
    prompts = random_prompts([9, 40, 130, 300, 77], seed=35)
    decided = [_assert_greedy_where_decided(ckpt, prompt, out.token_ids)
               for prompt, out in zip(prompts, llm.generate(prompts, greedy))]
    assert fresh, "no fresh prefill took FA4"
    llm.shutdown()
    # 256-token chunks: each prompt's later chunks continue over its earlier ones; the second
    # pass finds the prompts' full blocks cached and prefills the rest over them.
    llm = LLM(ckpt.path, dtype="bfloat16", device="cuda", kernels="aiter-triton",
              max_num_batched_tokens=256, max_model_len=512)
    prompts = random_prompts([480, 300], seed=36)
    for _ in range(2):
        decided += [_assert_greedy_where_decided(ckpt, prompt, out.token_ids)
                    for prompt, out in zip(prompts, llm.generate(prompts, greedy))]
    assert paged, "no prefill over cached context took FA4"
    assert sum(decided) >= len(decided) * 8, decided
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks

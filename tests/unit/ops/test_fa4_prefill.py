"""Which prefills ops/gpu/fa4_prefill.py hands to FlashAttention-4, decided without a GPU: the
cache layouts FA4 reads in place, and the steps that never take it (CPU tensors, fp32, short
lone prompts, few new tokens, sliding windows). Its kernel runs in tests/gpu."""
from __future__ import annotations

import pytest
import torch

from tandem.workers.ops.gpu import fa4_prefill


def test_the_engines_block_major_cache_views_are_read_in_place():
    # engine/model_runner.py: every layer's K and V are views of one [blocks, tensors, ...].
    stack = torch.zeros(10, 6, 16, 4, 64, dtype=torch.bfloat16)
    k_cache, v_cache = stack[:, 2], stack[:, 3]
    assert not k_cache.is_contiguous()
    assert fa4_prefill._pages_in_place(k_cache) and fa4_prefill._pages_in_place(v_cache)
    assert fa4_prefill._pages_in_place(torch.zeros(10, 16, 4, 64, dtype=torch.bfloat16))


def test_caches_fa4_would_copy_whole_are_not_taken():
    head_major = torch.zeros(10, 4, 16, 64, dtype=torch.bfloat16).transpose(1, 2)
    assert not fa4_prefill._pages_in_place(head_major)
    every_other_dim = torch.zeros(10, 16, 4, 128, dtype=torch.bfloat16)[..., ::2]
    assert not fa4_prefill._pages_in_place(every_other_dim)


def test_no_cpu_step_takes_fa4():
    q = torch.zeros(8192, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(8192, 2, 128, dtype=torch.bfloat16)
    cache = torch.zeros(600, 16, 2, 128, dtype=torch.bfloat16)
    assert not fa4_prefill.fa4_takes_fresh(q, k, num_seqs=4, num_tokens=8192,
                                           sliding_window=None)
    assert not fa4_prefill.fa4_takes_paged(q, cache, num_tokens=8192, sliding_window=None)


def test_short_steps_stop_before_the_device_checks(monkeypatch):
    """The token thresholds decide before FA4 is looked at (an import of seconds)."""
    monkeypatch.setattr(fa4_prefill, "_takes", lambda *args: True)
    q = k = torch.zeros(1, 1, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 1, 128, dtype=torch.bfloat16)
    lone, paged = fa4_prefill.LONE_MIN_TOKENS, fa4_prefill.PAGED_MIN_TOKENS
    assert not fa4_prefill.fa4_takes_fresh(q, k, 1, lone - 1, None)
    assert fa4_prefill.fa4_takes_fresh(q, k, 1, lone, None)
    assert fa4_prefill.fa4_takes_fresh(q, k, 2, 2, None)
    assert not fa4_prefill.fa4_takes_paged(q, cache, paged - 1, None)
    assert fa4_prefill.fa4_takes_paged(q, cache, paged, None)


def test_a_layout_fa4_refuses_falls_back_and_stays_off(monkeypatch, caplog):
    """A first call that raises (a layout this FA4 release does not build) returns None for
    the caller's default kernel, is logged, and that layout is not offered again; once a
    layout has run, its errors are raised as any kernel's."""
    monkeypatch.setattr(fa4_prefill, "_ran", set())
    monkeypatch.setattr(fa4_prefill, "_refused", set())
    q = torch.zeros(4, 8, 80, dtype=torch.bfloat16)
    k = v = torch.zeros(4, 2, 80, dtype=torch.bfloat16)

    def refuses(*args, **kwargs):
        raise AssertionError("head dim 80 is not supported")

    monkeypatch.setattr(fa4_prefill, "_forward", lambda: refuses)
    assert fa4_prefill._call("fresh", q, k, v) is None
    assert fa4_prefill._layout("fresh", q, k) in fa4_prefill._refused
    assert "does not run fresh prefills of 8 query / 2 KV heads of 80" in caplog.text
    assert fa4_prefill._layout("paged", q, k) not in fa4_prefill._refused

    monkeypatch.setattr(fa4_prefill, "_forward", lambda: lambda *a, **kw: (q + 1, None))
    assert torch.equal(fa4_prefill._call("paged", q, k, v), q + 1)
    monkeypatch.setattr(fa4_prefill, "_forward", lambda: refuses)
    with pytest.raises(AssertionError, match="head dim 80"):
        fa4_prefill._call("paged", q, k, v)


def test_launches_that_return_an_output_are_counted(monkeypatch):
    """num_calls tells a caller (bench/engine.py) whether a step ran on FA4."""
    monkeypatch.setattr(fa4_prefill, "_ran", set())
    monkeypatch.setattr(fa4_prefill, "_refused", set())
    monkeypatch.setattr(fa4_prefill, "num_calls", 0)
    q = k = v = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(fa4_prefill, "_forward", lambda: lambda *a, **kw: (q, None))
    fa4_prefill._call("fresh", q, k, v)
    fa4_prefill._call("fresh", q, k, v)
    assert fa4_prefill.num_calls == 2

    def refuses(*args, **kwargs):
        raise AssertionError("refused")

    monkeypatch.setattr(fa4_prefill, "_forward", lambda: refuses)
    assert fa4_prefill._call("paged", q, k, v) is None
    assert fa4_prefill.num_calls == 2

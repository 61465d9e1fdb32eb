"""Prefill CUDA graphs' buckets and when an engine captures them (the graphs themselves run in
tests/gpu/test_prefill_graphs_gpu.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from tandem.workers.engine.config import EngineConfig
from tandem.workers.engine.prefill_graphs import prefill_buckets
from tandem.workers.executor.executor import prefill_graph_tokens
from tandem.workers.ops.attention import Attention
from tandem.workers.ops.backend import KernelBackend


def test_buckets_grow_by_at_most_one_and_a_half_and_end_at_the_cap():
    assert prefill_buckets(2048) == [128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert prefill_buckets(1000) == [128, 192, 256, 384, 512, 768, 1000]
    assert prefill_buckets(128) == [128]
    assert prefill_buckets(127) == [] and prefill_buckets(0) == []
    for cap in (200, 3000, 8192):
        buckets = prefill_buckets(cap)
        assert buckets[-1] == cap and buckets == sorted(set(buckets))
        assert all(b / a <= 1.5 for a, b in zip(buckets, buckets[1:]))


def test_config_rejects_a_negative_cap(tmp_path):
    with pytest.raises(ValueError, match="prefill_graph_tokens=-1"):
        EngineConfig(model=str(tmp_path), prefill_graph_tokens=-1)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention(2, 8, 1.0, 2, KernelBackend.AITER_TRITON)


@pytest.mark.parametrize("capture_sizes, group, cap, max_batched, max_len, expected", [
    ([1, 2], None, 2048, 2048, 4096, 2048),
    ([1, 2], None, 2048, 512, 4096, 512),     # never past the largest step
    ([1, 2], None, 2048, 8192, 1000, 1000),   # nor max_model_len
    ([1, 2], None, 0, 2048, 4096, 0),         # switched off
    ([], None, 2048, 2048, 4096, 0),          # no decode graphs (CPU, eager, torch kernels)
    ([1, 2], object(), 2048, 2048, 4096, 0),  # TP ranks prefill eagerly
])
def test_when_an_engine_captures_prefill_graphs(tmp_path, capture_sizes, group, cap,
                                                max_batched, max_len, expected):
    config = EngineConfig(model=str(tmp_path), prefill_graph_tokens=cap,
                          max_num_batched_tokens=max_batched)
    loaded = SimpleNamespace(model=_Model(), max_model_len=max_len)
    assert prefill_graph_tokens(config, loaded, capture_sizes, group) == expected

"""bench/engine.py's printed table names the attention each prefill row ran, so runs with and
without flash-attn-4 installed are told apart, and says when the row's steps replayed a prefill
CUDA graph; no GPU, no FA4: fa4_in_use says None."""
from __future__ import annotations

import torch

from tandem.bench.engine import format_table
from tandem.workers.ops.gpu.fa4_prefill import fa4_in_use


def _results(attention: str | None, prefill_graph: bool | None = None) -> dict:
    row = {"ms": 125.3, "floor_ms": 90.6, "matmul_fraction": 0.723, "TFLOPs": 567.6}
    if attention is not None:
        row["attention"] = attention
    if prefill_graph is not None:
        row["prefill_graph"] = prefill_graph
    return {"limits": {"device": "NVIDIA H100 80GB HBM3", "copy_TBps": 2.98,
                       "bf16_matmul_TFLOPs": 785.0}, "kernels": "aiter-triton",
            "models": {"qwen3-30b-a3b": {"decode": {}, "prefill": {"8192": row}}}}


def test_prefill_rows_name_their_attention():
    table = format_table(_results("FlashAttention-4, flash-attn-4 4.0.0b36"))
    assert "prefill 8192" in table and "72% of matmul rate" in table
    assert table.rstrip().endswith("attention: FlashAttention-4, flash-attn-4 4.0.0b36")


def test_prefill_rows_say_when_a_graph_ran():
    graphed = format_table(_results("torch SDPA", prefill_graph=True))
    assert graphed.rstrip().endswith("attention: torch SDPA, from a prefill CUDA graph")
    assert "CUDA graph" not in format_table(_results("torch SDPA", prefill_graph=False))


def test_rows_of_earlier_runs_print_as_before():
    assert "attention" not in format_table(_results(None))


def test_no_cpu_device_runs_fa4():
    assert fa4_in_use(torch.device("cpu")) is None

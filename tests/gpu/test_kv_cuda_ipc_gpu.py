"""The cuda-ipc KV backend on real GPUs.

* Blocks move prefill (cuda:0, its own process) -> decode (cuda:1) bit-exactly, by the real
  KVTransferServicer (ExportKVCache, LeaseKV for handles without their blocks) and KVReceiver,
  two pulls at once into disjoint blocks, and by BlockCopier.copy alone; the
  grpc backend moves the same bytes (kv_transfer bench at a small size, which checks each
  handle's bytes, NaN bit patterns included: tests/unit/bench/test_kv_transfer_bench.py runs
  its grpc path on CPU).
* With one GPU, two worker processes on cuda:0 share the cache the same way.
* A router -> prefill (cuda:0) -> decode (cuda:1) stack with --kv-transfer cuda-ipc (no
  fallback allowed) gives transformers' greedy tokens and leaves no KV pinned or in use.
* The same with TP=2 on both workers (ranks on cuda:0 and cuda:1 each): every decode rank
  maps and copies its heads from the prefill rank of its number.
"""
from __future__ import annotations

import pytest
import torch
from helpers.handoff import decode_log_of_handoff_stack

from tandem.bench import kv_transfer

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
SMALL = ["--layers", "3", "--kv-heads", "2", "--head-dim", "64", "--block-size", "4",
         "--iters", "2", "--warmup", "1", "--copy-mib", "16"]


@needs_two_gpus
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_blocks_move_bit_exactly_between_two_gpus(dtype, tmp_path):
    out = tmp_path / "r.json"
    assert kv_transfer.main([*SMALL, "--dtype", dtype, "--blocks", "1,3,7",
                             "--concurrency", "2", "--out", str(out)]) == 0
    import json

    rows = json.loads(out.read_text())["rows"]
    assert {(r["backend"], r["blocks"]) for r in rows} == {
        (backend, n) for backend in ("grpc", "cuda-ipc", "cuda-ipc-lease", "cuda-ipc-copy",
                                     "cuda-ipc x2") for n in (1, 3, 7)}
    assert all(r["gbps"] > 0 and r["ratio"] > 0 for r in rows)


@pytest.mark.parametrize("decode_device", ["cuda:1", "cuda:0"])  # two GPUs; one GPU
def test_stack_with_cuda_ipc_gives_transformers_tokens(checkpoint, tmp_path, decode_device):
    log = decode_log_of_handoff_stack(checkpoint("qwen3"), tmp_path, decode_device,
                                      "cuda-ipc", seed=91)
    assert "over cuda-ipc" in log and "over grpc" not in log, log[-3000:]


@needs_two_gpus
def test_tp2_stack_with_cuda_ipc_gives_transformers_tokens(checkpoint, tmp_path):
    # llama: 2 KV heads, one per rank, so each rank's copy moves heads the other lacks.
    log = decode_log_of_handoff_stack(checkpoint("llama"), tmp_path, "cuda:0", "cuda-ipc",
                                      seed=92, tensor_parallel_size=2)
    assert "mapped on all 2 ranks" in log and "over grpc" not in log, log[-3000:]

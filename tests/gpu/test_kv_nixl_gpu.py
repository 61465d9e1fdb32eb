"""The nixl KV backend on real GPUs ("VRAM" descriptors; UCX picks CUDA IPC between two GPUs of
one host, RDMA between hosts).

* Blocks move prefill (cuda:0, its own process) -> decode (cuda:1) bit-exactly by LeaseKV and
  one NIXL READ (kv_transfer bench at a small size; it checks every handle's bytes).
* A router -> prefill (cuda:0) -> decode (cuda:1, or cuda:0 with one GPU) stack with
  --kv-transfer nixl (no fallback) gives transformers' greedy tokens and leaves no KV pinned or
  in use; so does a TP=2 -> TP=2 stack, whose ranks each READ their own KV heads.
"""
from __future__ import annotations

import json

import pytest
import torch
from helpers.handoff import decode_log_of_handoff_stack

from tandem.bench import kv_transfer
from tandem.workers.kv.nixl_agent import is_installed

pytestmark = pytest.mark.skipif(not is_installed(), reason="needs the nixl extra")
SMALL = ["--layers", "3", "--kv-heads", "2", "--head-dim", "64", "--block-size", "4",
         "--iters", "2", "--warmup", "1", "--copy-mib", "16"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_nixl_reads_blocks_bit_exactly_between_two_gpus(dtype, tmp_path):
    out = tmp_path / "r.json"
    assert kv_transfer.main([*SMALL, "--dtype", dtype, "--blocks", "1,3,7", "--backends",
                             "cuda-ipc,nixl", "--concurrency", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["backend"], r["blocks"]) for r in rows} == {
        (backend, n) for backend in ("cuda-ipc", "nixl") for n in (1, 3, 7)}


@pytest.mark.parametrize("decode_device", ["cuda:1", "cuda:0"])  # two GPUs; one GPU
def test_stack_with_nixl_gives_transformers_tokens(checkpoint, tmp_path, decode_device):
    log = decode_log_of_handoff_stack(checkpoint("qwen3"), tmp_path, decode_device,
                                      "nixl", seed=92)
    assert "over nixl" in log and "VRAM" in log and "over grpc" not in log, log[-3000:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_stack_with_nixl_gives_transformers_tokens(checkpoint, tmp_path):
    """TP=2 -> TP=2 over nixl: each rank's agent READs its KV head from the source's rank of
    the same number (VRAM to VRAM; llama's 2 KV heads, one per rank)."""
    log = decode_log_of_handoff_stack(checkpoint("llama"), tmp_path, "cuda:0", "nixl",
                                      seed=93, tensor_parallel_size=2)
    assert "on all 2 ranks" in log and "VRAM" in log and "over grpc" not in log, log[-3000:]

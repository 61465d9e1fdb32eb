"""A router -> prefill (cuda:0) -> decode stack handing KV off by one backend, checked against
transformers' greedy tokens; shared by the GPU tests of each KV transfer backend."""
from __future__ import annotations

import pytest
import torch
from helpers.checkpoints import random_prompts
from helpers.client import generate, request, worker_load
from helpers.processes import start_stack, stop


def decode_log_of_handoff_stack(ckpt, tmp_path, decode_device: str, kv_transfer: str,
                                seed: int, tensor_parallel_size: int = 1) -> str:
    """Runs 4 prompts (1-200 tokens) x 24 greedy tokens through the stack with --kv-transfer
    `kv_transfer` (no fallback), asserts transformers' tokens and that no KV stays pinned or in
    use, and returns the decode worker's log (for the caller's backend checks). Under TP both
    workers' rank r runs on cuda:(base + r)."""
    last = torch.device(decode_device).index + tensor_parallel_size - 1
    if torch.cuda.device_count() <= max(last, tensor_parallel_size - 1):
        pytest.skip(f"needs {max(last, tensor_parallel_size - 1) + 1} GPUs")
    stack = start_stack(ckpt.path, tmp_path, worker_args=[
        "--kernels", "torch", "--max-num-seqs", "8", "--kv-transfer", kv_transfer,
        "--tensor-parallel-size", str(tensor_parallel_size)],
        role_args={"prefill": ["--device", "cuda:0"], "decode": ["--device", decode_device]})
    try:
        for prompt in random_prompts([1, 17, 33, 200], seed=seed):
            result = generate(stack.router.address, request(prompt, max_tokens=24))
            assert result.token_ids == ckpt.greedy(prompt, 24), f"{len(prompt)}-token prompt"
        for worker in stack.workers.values():
            load = worker_load(worker.address)
            assert load.kv_usage == 0 and load.num_pinned == 0
        return stack.workers["decode-0"].log_path.read_text()
    finally:
        stop(stack.processes)

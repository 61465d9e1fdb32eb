"""The GPU paths of the split and of tensor/expert parallelism, as real processes.

* A router -> prefill -> decode stack whose workers run the aiter-triton kernels on one GPU
  (KV moves from one GPU cache to the other through the gRPC backend) gives transformers'
  greedy tokens, and both workers end with no KV in use.
* With two or more GPUs: TP=2 (NCCL all-reduces, ranks on cuda:0 and cuda:1) and EP=2 give
  transformers' greedy tokens offline, in fp32; with the aiter-triton kernels TP=2 decode
  replays CUDA graphs that both ranks captured together.
* A TP=2 worker whose follower is killed mid-generation (its decode graphs replaying NCCL
  all-reduces that now wait forever) still exits by itself, with LOST_FOLLOWER_EXIT_CODE, and
  the client's stream ends instead of hanging.
"""
from __future__ import annotations

import os
import signal
import threading

import grpc
import pytest
import torch
from helpers.checkpoints import PARITY_LENGTHS, assert_greedy_parity, random_prompts
from helpers.client import generate, request, worker_load
from helpers.processes import child_pids, free_port, start, start_stack, stop, wait_serving

from tandem import LLM, SamplingParams
from tandem.common.convert import engine_params_to_proto
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.workers.server import LOST_FOLLOWER_EXIT_CODE
from tandem.workers.ops.aiter_compat import aiter_available

needs_aiter = pytest.mark.skipif(not aiter_available(), reason="amd-aiter is not installed")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@needs_aiter
def test_prefill_decode_stack_on_gpu_gives_transformers_tokens(checkpoint, tmp_path):
    ckpt = checkpoint("qwen3")
    stack = start_stack(ckpt.path, tmp_path, worker_args=[
        "--device", "cuda", "--kernels", "aiter-triton", "--max-num-seqs", "8"])
    try:
        for prompt in random_prompts([1, 33, 200], seed=81):
            result = generate(stack.router.address, request(prompt, max_tokens=24))
            assert result.token_ids == ckpt.greedy(prompt, 24), f"{len(prompt)}-token prompt"
        for worker in stack.workers.values():
            load = worker_load(worker.address)
            assert load.kv_usage == 0 and load.num_pinned == 0
    finally:
        stop(stack.processes)


@needs_two_gpus
@pytest.mark.parametrize("kernels", ["torch", "aiter-triton"])
def test_tensor_parallel_on_two_gpus(checkpoint, kernels):
    if kernels == "aiter-triton" and not aiter_available():
        pytest.skip("amd-aiter is not installed")
    ckpt = checkpoint("qwen3")
    with LLM(ckpt.path, dtype="float32", device="cuda", kernels=kernels,
             tensor_parallel_size=2) as llm:
        assert_greedy_parity(llm, ckpt, random_prompts(PARITY_LENGTHS, seed=82))
        for prompt in random_prompts([5, 40], seed=83):  # alone: batch-1 steps (fused GEMVs
            assert_greedy_parity(llm, ckpt, [prompt])    # on aiter-triton, all-reduced)
        graphs = llm.engine.runner.graphs
        if kernels == "aiter-triton":  # every rank captured; decode steps replayed in step
            assert graphs is not None and graphs.num_replays > 0
        else:
            assert graphs is None  # the torch kernels make host-side decisions


@needs_two_gpus
def test_expert_parallel_on_two_gpus(moe_checkpoint):
    ckpt = moe_checkpoint("qwen3_moe")
    with LLM(ckpt.path, dtype="float32", device="cuda", kernels="torch",
             tensor_parallel_size=2, enable_expert_parallel=True) as llm:
        assert_greedy_parity(llm, ckpt, random_prompts(PARITY_LENGTHS[:5], seed=83))


@needs_aiter
@needs_two_gpus
def test_tp2_gpu_worker_exits_when_its_follower_dies_mid_generation(checkpoint, tmp_path):
    ckpt = checkpoint("qwen3")
    port = free_port()
    worker = start("both", ["tandem.workers.server", "--role", "both", "--model",
                            str(ckpt.path), "--port", str(port), "--device", "cuda",
                            "--kernels", "aiter-triton", "--tensor-parallel-size", "2",
                            "--skip-warm-up"], port, tmp_path)
    try:
        wait_serving([worker])
        assert "captured" in worker.log_path.read_text()  # decode replays graphs
        params = engine_params_to_proto(SamplingParams(temperature=0, max_tokens=470,
                                                       min_tokens=470))
        first_token, ended = threading.Event(), []

        def generate_long() -> None:
            with grpc.insecure_channel(worker.address) as channel:
                try:
                    for _ in worker_pb2_grpc.WorkerStub(channel).Decode(worker_pb2.DecodeRequest(
                            request_id="long", prompt_token_ids=list(range(1, 30)),
                            params=params), timeout=120):
                        first_token.set()
                    ended.append("complete")
                except grpc.RpcError as exc:
                    ended.append(exc.code())

        client = threading.Thread(target=generate_long)
        client.start()
        assert first_token.wait(60)
        [follower] = child_pids(worker.popen.pid)
        os.kill(follower, signal.SIGKILL)
        assert worker.popen.wait(timeout=60) == LOST_FOLLOWER_EXIT_CODE
        client.join(30)
        assert not client.is_alive() and ended and ended[0] != "complete", ended
    finally:
        stop([worker])

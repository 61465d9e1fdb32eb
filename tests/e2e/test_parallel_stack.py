"""Tensor/expert-parallel workers as real processes (each worker = rank 0 + one follower over
gloo): router -> prefill TP=2 -> decode TP=2 gives transformers' greedy tokens with the KV of
both ranks handed over; a TP=1 decode worker refuses a TP=2 handle naming tp_size; no
follower outlives its worker, whether the worker stops or is killed; a worker whose follower
dies stops; a SIGTERM to a worker's whole process group (systemd, a Ctrl-C) drains its
in-flight streams before the ranks stop."""
from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
from helpers.checkpoints import random_prompts
from helpers.client import generate, request, worker_load
from helpers.processes import (child_pids, free_port, start, start_stack, stop, wait_gone,
                               wait_serving)

from tandem import SamplingParams
from tandem.common.convert import engine_params_to_proto
from tandem.v1 import generate_pb2, worker_pb2, worker_pb2_grpc
from tandem.workers.server import LOST_FOLLOWER_EXIT_CODE

TP2 = ["--tensor-parallel-size", "2"]


def check_stack_tokens(stack, ckpt, lengths: list[int], seed: int) -> None:
    for prompt in random_prompts(lengths, seed=seed):
        result = generate(stack.router.address, request(prompt, max_tokens=16))
        assert result.token_ids == ckpt.greedy(prompt, 16), f"prompt of {len(prompt)} tokens"
        assert result.complete.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    for worker in stack.workers.values():  # every block was handed over and freed
        load = worker_load(worker.address)
        assert load.kv_usage == 0 and load.num_pinned == 0


@pytest.mark.parametrize("variant,worker_args", [
    ("llama", TP2),  # 2 KV heads: one per rank, so the handoff must move both ranks' heads
    ("qwen3_moe", [*TP2, "--enable-expert-parallel"]),  # 8 experts, 4 per rank
])
def test_parallel_prefill_and_decode_give_transformers_tokens(checkpoint, moe_checkpoint,
                                                              tmp_path, variant, worker_args):
    ckpt = moe_checkpoint(variant) if variant == "qwen3_moe" else checkpoint(variant)
    stack = start_stack(ckpt.path, tmp_path, worker_args=worker_args)
    try:
        followers = [pid for w in stack.workers.values() for pid in child_pids(w.popen.pid)]
        assert len(followers) == 2  # one per worker
        check_stack_tokens(stack, ckpt, [1, 40, 200], seed=71)
        # A worker that lost a rank cannot run its model: it stops (non-zero) by itself.
        decode = stack.workers["decode-0"].popen
        [decode_follower] = child_pids(decode.pid)
        os.kill(decode_follower, signal.SIGKILL)
        assert decode.wait(timeout=20) == LOST_FOLLOWER_EXIT_CODE
    finally:
        stop(stack.processes)
    wait_gone(followers, timeout=30)


def test_tp1_decode_refuses_a_tp2_handle_and_followers_die_with_their_worker(checkpoint,
                                                                             tmp_path):
    ckpt = checkpoint("llama")
    workers = {}
    for role, args in (("prefill", TP2), ("decode", [])):
        port = free_port()
        workers[role] = start(role, ["tandem.workers.server", "--role", role, "--model",
                                     str(ckpt.path), "--port", str(port), "--dtype", "float32",
                                     *args], port, tmp_path)
    try:
        wait_serving(list(workers.values()))
        params = engine_params_to_proto(SamplingParams(temperature=0, max_tokens=8))
        prompt = list(range(1, 40))
        with grpc.insecure_channel(workers["prefill"].address) as channel:
            prefilled = worker_pb2_grpc.WorkerStub(channel).Prefill(worker_pb2.PrefillRequest(
                request_id="r1", prompt_token_ids=prompt, params=params, keep_kv=True),
                timeout=30)
        assert prefilled.kv_handle.layout.tp_size == 2
        with grpc.insecure_channel(workers["decode"].address) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                list(worker_pb2_grpc.WorkerStub(channel).Decode(worker_pb2.DecodeRequest(
                    request_id="r1", prompt_token_ids=prompt,
                    generated_token_ids=[prefilled.token_id], params=params,
                    kv_handle=prefilled.kv_handle), timeout=30))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "tp_size: source 2 != receiver 1" in refused.value.details()
        assert worker_load(workers["decode"].address).kv_usage == 0

        [follower] = child_pids(workers["prefill"].popen.pid)
        os.kill(workers["prefill"].popen.pid, signal.SIGKILL)  # no chance to stop it
        wait_gone([follower], timeout=30)
    finally:
        stop(list(workers.values()))


def test_sigterm_to_the_whole_process_group_drains_a_tp2_worker(checkpoint, tmp_path):
    ckpt = checkpoint("llama")
    stack = start_stack(ckpt.path, tmp_path, num_prefill=0, num_decode=0, num_both=1,
                        worker_args=[*TP2, "--shutdown-grace-seconds", "30"])
    try:
        worker = stack.workers["both-0"]
        [follower] = child_pids(worker.popen.pid)
        prompt = random_prompts([12], seed=5)[0]
        result = {}
        thread = threading.Thread(target=lambda: result.update(done=generate(
            stack.router.address, request(prompt, max_tokens=300), timeout=60)))
        thread.start()
        deadline = time.monotonic() + 20
        while worker_load(worker.address).num_running == 0:
            assert time.monotonic() < deadline, "the stream never started"
            time.sleep(0.05)
        os.killpg(worker.popen.pid, signal.SIGTERM)  # rank 0 and its follower alike
        thread.join(timeout=60)
        assert result["done"].token_ids == ckpt.greedy(prompt, 300)  # finished in the grace
        assert worker.popen.wait(timeout=30) == 0
        wait_gone([follower], timeout=30)
        assert "model step failed" not in worker.log_path.read_text()
    finally:
        stop(stack.processes)

"""A decode worker whose KV cache is MHA refuses the MLA latent blocks of a DeepSeek prefill
worker: the client gets FAILED_PRECONDITION naming both kinds, and no worker keeps blocks."""
from __future__ import annotations

import time

import grpc
import pytest
from helpers.client import generate, request, worker_load
from helpers.processes import free_port, start, stop, wait_serving


def _worker(role: str, model, log_dir):
    port = free_port()
    return start(role, ["tandem.workers.server", "--role", role, "--model", str(model),
                        "--port", str(port), "--dtype", "float32"], port, log_dir)


def test_mha_decode_worker_refuses_an_mla_handle(checkpoint, moe_checkpoint, tmp_path):
    mla_model = moe_checkpoint("deepseek_v3").path  # same vocabulary as the tiny Llama
    prefill, decode = _worker("prefill", mla_model, tmp_path), \
        _worker("decode", checkpoint("llama").path, tmp_path)
    processes = [prefill, decode]
    try:
        wait_serving(processes)
        port = free_port()
        router = start("router", ["tandem.router.server", "--model", str(mla_model), "--port",
                                  str(port), "--health-check-interval", "0.5", "--prefill",
                                  prefill.address, "--decode", decode.address], port, tmp_path)
        processes.append(router)
        wait_serving([router])
        with pytest.raises(grpc.RpcError) as info:
            generate(router.address, request(list(range(1, 40)), max_tokens=8))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "source keeps a 'mla' KV cache and this worker a 'mha' one" in \
            info.value.details()
        assert "kind: source 'mla' != receiver 'mha'" in info.value.details()
        deadline = time.monotonic() + 5
        while any(worker_load(w.address).num_pinned or worker_load(w.address).kv_usage
                  for w in (prefill, decode)):  # the router's Abort frees the pinned prompt
            assert time.monotonic() < deadline, "a worker still holds blocks"
            time.sleep(0.05)
    finally:
        stop(processes)

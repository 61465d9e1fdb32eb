"""Scaling decode 1 -> 2 -> 1 under load with workers discovered through a target the test
controls (file:///..., the same seam dns:///name:port uses): no request is lost."""
from __future__ import annotations

import signal
import threading
import time

import grpc
from helpers.client import generate, request, worker_load
from helpers.processes import free_port, start, stop, wait_serving, wait_until, write_targets

WORKER_FLAGS = ["--dtype", "float32", "--drain-delay-seconds", "2",
                "--shutdown-grace-seconds", "20"]


def worker(name, role, model, log_dir):
    port = free_port()
    return start(name, ["tandem.workers.server", "--role", role, "--model", str(model),
                        "--port", str(port), *WORKER_FLAGS], port, log_dir)



def test_scale_decode_up_and_down_under_load_loses_nothing(checkpoint, tmp_path):
    model = checkpoint("llama").path
    prefill = worker("prefill-0", "prefill", model, tmp_path)
    decode0 = worker("decode-0", "decode", model, tmp_path)
    decode1 = worker("decode-1", "decode", model, tmp_path)
    prefill_file, decode_file = tmp_path / "prefill.txt", tmp_path / "decode.txt"
    write_targets(prefill_file, [prefill.address])
    write_targets(decode_file, [decode0.address])
    port = free_port()
    router = start("router", ["tandem.router.server", "--model", str(model), "--port", str(port),
                              "--prefill", f"file://{prefill_file}",
                              "--decode", f"file://{decode_file}",
                              "--health-check-interval", "0.3"], port, tmp_path)
    processes = [prefill, decode0, decode1, router]
    try:
        wait_serving([prefill, decode0, decode1, router])
        outcomes: list[object] = []
        running = threading.Event()
        running.set()

        def load(index):
            i = 0
            while running.is_set():
                try:
                    result = generate(router.address, request([5 + index, i % 50], max_tokens=24),
                                      timeout=60)
                    outcomes.append(result.complete.usage.completion_tokens)
                except grpc.RpcError as exc:
                    outcomes.append(f"{exc.code().name}: {exc.details()}")
                i += 1

        threads = [threading.Thread(target=load, args=(k,)) for k in range(4)]
        for thread in threads:
            thread.start()
        time.sleep(1.5)
        write_targets(decode_file, [decode0.address, decode1.address])  # scale up
        wait_until(lambda: worker_load(decode1.address).num_running > 0, timeout=20)
        time.sleep(1.0)
        # Scale down as Kubernetes does: the pod leaves the endpoints and gets SIGTERM.
        write_targets(decode_file, [decode0.address])
        decode1.popen.send_signal(signal.SIGTERM)
        time.sleep(3.0)
        running.clear()
        for thread in threads:
            thread.join(timeout=60)
        assert decode1.popen.wait(timeout=30) == 0
        failures = [o for o in outcomes if not isinstance(o, int)]
        assert not failures, f"lost requests: {failures}"
        assert len(outcomes) > 20 and all(o == 24 for o in outcomes)
    finally:
        stop(processes)

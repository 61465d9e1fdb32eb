"""`tandem router --processes 2`: two router processes on one port behind one parent."""
from __future__ import annotations

import os
import signal
import time
import urllib.request

import grpc
import pytest
from helpers.client import generate, request, router_counter
from helpers.processes import (child_pids, free_port, start_stack, stop, wait_gone,
                               wait_until)
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow
NUM_TOKENS = 4


@pytest.fixture(scope="module")
def two_process_router(checkpoint, tmp_path_factory):
    """One aggregated worker behind a router of two processes; yields (stack, metrics)."""
    metrics_address = f"127.0.0.1:{free_port()}"
    stack = start_stack(checkpoint("llama").path, tmp_path_factory.mktemp("processes_logs"),
                        num_prefill=0, num_decode=0, num_both=1,
                        router_args=["--processes", "2", "--metrics-port",
                                     metrics_address.rsplit(":", 1)[1]])
    # The stack is ready once one process answers; wait for both to have the worker in their
    # pools and serve their metrics, else the first requests all land on one process.
    worker = stack.workers["both-0"]
    wait_until(lambda: stack.router.log_path.read_text(errors="replace").count(
        f"worker {worker.address} joined the pool") >= 2
        and all(serves_metrics(metrics_address, i) for i in (0, 1)), timeout=60)
    yield stack, metrics_address
    stop(stack.processes)


def finished(metrics_address: str, path: str = "/metrics") -> float:
    """tandem:requests_finished_total{status="length"} on the page at `path`."""
    with urllib.request.urlopen(f"http://{metrics_address}{path}", timeout=5) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == "tandem:requests_finished_total"
               and sample.labels.get("status") == "length")


def serves_metrics(metrics_address: str, index: int) -> bool:
    try:
        finished(metrics_address, f"/metrics/process/{index}")
        return True
    except OSError:  # 404 while the process restarts
        return False


def send_requests(address: str, count: int, max_reconnects: int = 0) -> None:
    """`count` requests, each on its own connection (one connection stays on one process).
    max_reconnects: connections refused UNAVAILABLE that may be retried once each, as a client
    retries a connection the kernel had queued on a process that died."""
    for index in range(count):
        for attempt in range(max_reconnects + 1):
            try:
                result = generate(address, request(f"request {index}", max_tokens=NUM_TOKENS))
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == max_reconnects:
                    raise
                max_reconnects -= 1
                time.sleep(0.2)
        assert len(result.token_ids) == NUM_TOKENS
        assert result.complete.finish_reason != 0


def test_both_processes_take_requests_and_metrics_show_the_sum(two_process_router):
    stack, metrics_address = two_process_router
    before = [finished(metrics_address, f"/metrics/process/{i}") for i in (0, 1)]
    send_requests(stack.router.address, 24)
    per_process = [finished(metrics_address, f"/metrics/process/{i}") - before[i]
                   for i in (0, 1)]
    assert all(count > 0 for count in per_process), per_process
    assert sum(per_process) == 24
    assert finished(metrics_address) == sum(before) + 24


def test_a_killed_process_is_replaced_and_requests_keep_succeeding(two_process_router):
    stack, metrics_address = two_process_router
    children = child_pids(stack.router.popen.pid)
    assert len(children) == 2, children
    os.kill(children[0], signal.SIGKILL)
    # A connection the kernel still handed to the dead process's socket is reset (at most a
    # couple, around the kill); a retry reaches the live process, which serves the rest.
    wait_gone([children[0]], timeout=10)
    send_requests(stack.router.address, 6, max_reconnects=2)
    wait_until(lambda: len(set(child_pids(stack.router.popen.pid)) - {children[0]}) == 2,
               timeout=60)
    assert router_counter(metrics_address, "tandem:router_process_restarts") == 1
    # The replacement serves too: requests reach both processes again.
    wait_until(lambda: all(serves_metrics(metrics_address, i) for i in (0, 1)), timeout=60)
    before = [finished(metrics_address, f"/metrics/process/{i}") for i in (0, 1)]
    send_requests(stack.router.address, 24)
    after = [finished(metrics_address, f"/metrics/process/{i}") for i in (0, 1)]
    assert all(a > b for a, b in zip(after, before)), (before, after)

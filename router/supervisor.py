"""`tandem router --processes N`: N router processes on one port, kept alive by this parent.

Python relays a stream's tokens on one core per process, so a router that must relay more
runs several processes. The parent serves nothing of the API itself: it starts N children
(`tandem.router.server` with the same flags plus `--processes 1`), each listening on the same
--port (and --http-port) with SO_REUSEPORT, so the kernel spreads new connections over them.
Every child has its own worker pool, health checks and metrics. Admission limits keep their
meaning for the whole router: child i gets its share of --max-concurrency and --max-queue
(the shares add up to the flags).

A child that exits while the parent is not stopping is started again after
RESTART_DELAY_SECONDS (its in-flight streams fail; clients reconnect to the others).
SIGTERM/SIGINT go to every child, which drains as a single router does; the parent waits for
them. Children get SIGTERM if the parent dies (PR_SET_PDEATHSIG).

With --metrics-port the parent serves /metrics: every child's series summed (router/
metrics_aggregation.py) plus the parent's own (restarts, live children); /metrics/process/<i>
is child i's own page. Each child serves its metrics on a private 127.0.0.1 port.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from tandem.common.logging import get_logger
from tandem.common.metrics import RouterSupervisorMetrics, serve_metrics
from tandem.common.ports import free_port
from tandem.router.metrics_aggregation import SummedPages, fetch_page

logger = get_logger("tandem.router")
RESTART_DELAY_SECONDS = 1.0
POLL_SECONDS = 0.2
# Beyond the children's own drain (--drain-delay-seconds + --shutdown-grace-seconds).
EXIT_MARGIN_SECONDS = 5.0
_PR_SET_PDEATHSIG = 1


def default_num_processes(max_concurrency: int) -> int:
    """A quarter of the cores this process may run on (at least 1, at most 8, and no more than
    --max-concurrency allows): workers and their gRPC threads often share the host, and one
    router process relays several thousand tokens a second."""
    try:
        num_cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        num_cores = os.cpu_count() or 1
    return max(1, min(8, num_cores // 4, max_concurrency))


def share(total: int, num_parts: int, index: int) -> int:
    """Part `index` of `total` split into `num_parts` near-equal parts that add up to it."""
    return total // num_parts + (index < total % num_parts)


@dataclass
class Child:
    index: int
    argv: list[str]
    metrics_port: int
    popen: subprocess.Popen | None = None
    restart_at: float | None = None  # when to start it again after an exit

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


class Supervisor:
    def __init__(self, argv: list[str], num_processes: int, max_concurrency: int,
                 max_queue: int, stop_timeout_seconds: float, model_name: str) -> None:
        if num_processes < 2:
            raise ValueError(f"--processes={num_processes}: a supervisor runs 2 or more")
        if max_concurrency < num_processes:
            raise ValueError(f"--max-concurrency={max_concurrency} is below --processes="
                             f"{num_processes}: every process needs at least one slot")
        self.metrics = RouterSupervisorMetrics(model_name)
        self.stop_timeout_seconds = stop_timeout_seconds
        self.children = [
            Child(i, [*argv, "--processes", "1", "--process-index", str(i),
                      "--max-concurrency", str(share(max_concurrency, num_processes, i)),
                      "--max-queue", str(share(max_queue, num_processes, i)),
                      "--metrics-host", "127.0.0.1"], free_port())
            for i in range(num_processes)]
        self._stopping = threading.Event()

    def serve_metrics(self, port: int, host: str) -> None:
        """/metrics: the children's pages summed, and this process's own series;
        /metrics/process/<i>: child i's page as it serves it."""
        self.metrics.registry.register(SummedPages(
            lambda: [child.metrics_url for child in self.children]))
        serve_metrics(self.metrics.registry, port, host, self._child_page)

    def _child_page(self, path: str) -> bytes | None:
        prefix, _, index = path.rpartition("/")
        if prefix != "/metrics/process" or not index.isdigit() or \
                int(index) >= len(self.children):
            return None
        page = fetch_page(self.children[int(index)].metrics_url)
        return page.encode() if page is not None else None

    def run(self) -> int:
        """Starts the children and keeps them alive until SIGTERM/SIGINT; returns the exit
        status."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stopping.set())
        for child in self.children:
            self._start(child)
        self.metrics.num_processes.set_function(
            lambda: sum(c.popen is not None and c.popen.poll() is None for c in self.children))
        while not self._stopping.wait(POLL_SECONDS):
            now = time.monotonic()
            for child in self.children:
                if child.restart_at is not None and now >= child.restart_at:
                    self._start(child)
                elif child.restart_at is None and child.popen.poll() is not None:
                    logger.warning("router process %d (pid %d) exited with status %s; "
                                   "starting it again in %.0f s", child.index, child.popen.pid,
                                   child.popen.returncode, RESTART_DELAY_SECONDS)
                    child.restart_at = now + RESTART_DELAY_SECONDS
                    self.metrics.process_restarts.inc()
        return self._stop()

    def _start(self, child: Child) -> None:
        child.restart_at = None
        child.popen = subprocess.Popen(
            [sys.executable, "-m", "tandem.router.server", *child.argv,
             "--metrics-port", str(child.metrics_port)], preexec_fn=_die_with_parent)
        logger.info("router process %d: pid %d", child.index, child.popen.pid)

    def _stop(self) -> int:
        logger.info("stopping %d router processes", len(self.children))
        running = [c.popen for c in self.children if c.popen is not None
                   and c.popen.poll() is None]
        for popen in running:
            popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_seconds
        for popen in running:
            try:
                popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("router process pid %d did not stop in time; killing it",
                               popen.pid)
                popen.kill()
                popen.wait()
        return 0


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the supervisor dies, however it dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

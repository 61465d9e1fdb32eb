"""One `tandem up` run under a benchmark's control: its children's addresses and pids, SIGKILL
and restart of a worker, each process's resident memory, the workers' load.

`tandem up` starts the workers and the router and stops them on SIGTERM; it does not restart a
child that dies. A restart here runs the dead worker's own command line again (read from
/proc before the kill), so the new process serves the same port with the same flags and the
router, which knows its workers by address, takes it back on its first good health check.
Restarted workers are this object's children, not `tandem up`'s: `stop` stops them as well.
Linux only (/proc).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.bench.metrics_scrape import scrape
from tandem.bench.proc_stats import child_pids, is_running, rss_bytes
from tandem.common.ports import free_port
from tandem.common.security import INTERNAL_TOKEN_KEY
from tandem.v1 import worker_pb2, worker_pb2_grpc

__all__ = ["UpStack", "UpChild", "is_serving"]
READY_TIMEOUT_S = 600.0
_TABLE_LINE = re.compile(r"\s+(\S+)\s+(\S+)\s+metrics http://(\S+)/metrics")


@dataclass(slots=True)
class UpChild:
    """One process of the stack: `name` as `tandem up` prints it (router, prefill-0, ...)."""
    name: str
    address: str
    metrics_address: str
    pid: int
    argv: list[str]
    popen: subprocess.Popen | None = None  # set once this object restarted it

    @property
    def role(self) -> str:
        return self.name.rsplit("-", 1)[0]


def is_serving(address: str, timeout: float = 1.0) -> bool:
    """grpc.health.v1 says SERVING within `timeout` seconds."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


class UpStack:
    """`tandem up ARGS` started in its own session, its output in `log_dir`/up.log."""

    def __init__(self, up_args: list[str], log_dir: Path,
                 omp_num_threads: str | None = "1") -> None:
        """omp_num_threads: the children's OMP_NUM_THREADS where the environment sets none
        (one thread per CPU worker keeps workers on a shared machine from oversubscribing it);
        None leaves the environment as it is."""
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        token_file = log_dir / "internal-token"
        token_file.write_text("tandem-bench-internal-token\n")
        self.internal_token = "tandem-bench-internal-token"
        self.port = free_port()
        env = dict(os.environ)
        if omp_num_threads is not None:
            env.setdefault("OMP_NUM_THREADS", omp_num_threads)
        self.up = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "up", *up_args, "--port", str(self.port),
             "--internal-token-file", str(token_file)],
            stdout=subprocess.PIPE, stderr=open(log_dir / "up.log", "w"), text=True, env=env,
            start_new_session=True)
        self.children: dict[str, UpChild] = {}
        self._num_restarts = 0
        try:
            self._read_table()
        except BaseException:
            self.stop()
            raise

    def _read_table(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        table = {}
        for line in self.up.stdout:
            match = _TABLE_LINE.match(line)
            if match:
                table[match.group(1)] = (match.group(2), match.group(3))
            if line.startswith("Ctrl-C") or time.monotonic() > deadline:
                break
        if "router" not in table:
            raise RuntimeError("tandem up did not start; its log:\n"
                               + (self.log_dir / "up.log").read_text()[-3000:])
        by_port = {}
        for pid in child_pids(self.up.pid):
            argv = _argv(pid)
            if "--port" in argv:
                by_port[argv[argv.index("--port") + 1]] = (pid, argv)
        for name, (address, metrics_address) in table.items():
            pid, argv = by_port[address.rpartition(":")[2]]
            self.children[name] = UpChild(name, address.replace("0.0.0.0", "127.0.0.1"),
                                          metrics_address, pid, argv)

    @property
    def router(self) -> UpChild:
        return self.children["router"]

    @property
    def workers(self) -> list[UpChild]:
        return [c for name, c in self.children.items() if name != "router"]

    def kill(self, child: UpChild, timeout: float = 30.0) -> None:
        """SIGKILL one child and wait until it is gone."""
        os.kill(child.pid, signal.SIGKILL)
        if child.popen is not None:
            child.popen.wait(timeout)
        deadline = time.monotonic() + timeout
        while is_running(child.pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{child.name} (pid {child.pid}) outlived SIGKILL")
            time.sleep(0.05)

    def restart(self, child: UpChild) -> None:
        """Run a killed child's command line again; returns once it started (not yet ready)."""
        self._num_restarts += 1
        log = open(self.log_dir / f"{child.name}-restart{self._num_restarts}.log", "w")
        child.popen = subprocess.Popen(child.argv, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        child.pid = child.popen.pid

    def wait_serving(self, child: UpChild, timeout: float = READY_TIMEOUT_S) -> float:
        """Seconds until `child` reports SERVING; raises RuntimeError when it exits first."""
        started = time.monotonic()
        while not is_serving(child.address):
            if not is_running(child.pid):
                raise RuntimeError(f"{child.name} exited while starting")
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"{child.name} not serving after {timeout:g} s")
            time.sleep(0.2)
        return time.monotonic() - started

    def rss(self) -> dict[str, int]:
        """Resident bytes of every child, by name."""
        return {name: rss_bytes(child.pid) for name, child in self.children.items()}

    def load(self, child: UpChild) -> worker_pb2.GetLoadResponse:
        with grpc.insecure_channel(child.address) as channel:
            return worker_pb2_grpc.WorkerStub(channel).GetLoad(
                worker_pb2.GetLoadRequest(), timeout=5,
                metadata=[(INTERNAL_TOKEN_KEY, self.internal_token)])

    def samples(self, child: UpChild, name: str) -> list:
        """Every sample called `name` on `child`'s /metrics page now."""
        return [sample for sample in scrape(child.metrics_address) if sample.name == name]

    def router_counter(self, name: str) -> float:
        """The sum of every sample of counter `name` (without _total) on the router."""
        return sum(sample.value for sample in self.samples(self.router, f"{name}_total"))

    def workers_in_pool(self) -> set[str]:
        """Addresses of the workers the router has in its routing pool now."""
        return {sample.labels["worker"]
                for sample in self.samples(self.router, "tandem:worker_healthy")
                if sample.value == 1}

    def stop(self, grace: float = 30.0) -> int:
        """SIGTERM `tandem up` (it stops its own children) and the restarted workers; returns
        `tandem up`'s exit status."""
        restarted = [c.popen for c in self.children.values() if c.popen is not None]
        for popen in [self.up, *restarted]:
            if popen.poll() is None:
                popen.send_signal(signal.SIGTERM)
        for popen in [self.up, *restarted]:
            try:
                popen.wait(grace)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
        return self.up.returncode

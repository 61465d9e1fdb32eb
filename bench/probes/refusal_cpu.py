"""Router CPU per refused call, for token-id and text prompts.

    python bench/probes/refusal_cpu.py [--bursts 5] [--burst-size 160]

A router (`--max-concurrency 16 --max-queue 0`, one process) in front of bench/router_fakes.py's
fake worker is filled by 16 long streams; then `--bursts` bursts of `--burst-size` calls, each
on its own connection, are all refused RESOURCE_EXHAUSTED. Prints the router's CPU seconds
(from /proc) over the bursts divided by the refusals (the 16 streams' relaying and each
client's GetModelInfo dial included) and the client-side time to each refusal.
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

import grpc
import numpy as np

from tandem.bench.overload import seeded_prompts
from tandem.bench.proc_stats import tree_cpu_seconds
from tandem.bench.router import _default_model, _free_port, _wait_serving
from tandem.bench.router_fakes import corpus_text, start_fake_worker
from tandem.client import AsyncTandemClient

NUM_HELD = 16  # the router's --max-concurrency, filled before the bursts


async def refusal_times_ms(address: str, prompts: list) -> list[float]:
    clients = [AsyncTandemClient(address, timeout=600) for _ in prompts]
    await asyncio.gather(*(client.model_info() for client in clients))
    times: list[float] = []

    async def one(client, prompt) -> None:
        sent = time.perf_counter()
        try:
            await client.generate(prompt, max_tokens=64, temperature=0.0, ignore_eos=True)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            times.append((time.perf_counter() - sent) * 1000)

    await asyncio.gather(*(one(c, p) for c, p in zip(clients, prompts)))
    await asyncio.gather(*(client.close() for client in clients))
    return times


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
    args = p.parse_args()
    model = str(_default_model())
    worker_port, router_port = _free_port(), _free_port()
    worker_process, worker = start_fake_worker(model, worker_port, 0.5)
    token_file = tempfile.NamedTemporaryFile("w", prefix="tandem-probe-token-", delete=False)
    token_file.write("tandem-probe-internal-token")
    token_file.close()
    router = subprocess.Popen(
        [sys.executable, "-m", "tandem.router.server", "--model", model, "--port",
         str(router_port), "--both", f"127.0.0.1:{worker_port}", "--max-concurrency",
         str(NUM_HELD), "--max-queue", "0", "--internal-token-file", token_file.name,
         "--processes", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        start_new_session=True)
    address = f"127.0.0.1:{router_port}"
    stop = threading.Event()
    holder = threading.Thread(target=lambda: asyncio.run(hold_streams(address, stop)))
    try:
        _wait_serving(address, router)
        holder.start()
        time.sleep(5)  # the held streams are running
        text = corpus_text()
        for kind in ("token_ids", "text"):
            times, cpu = [], 0.0
            for index in range(args.bursts):
                prompts = (seeded_prompts(args.burst_size, 32, 49152, index)
                           if kind == "token_ids" else
                           [text[i * 37:i * 37 + 2000] for i in range(args.burst_size)])
                started_cpu = tree_cpu_seconds(router.pid)
                times += asyncio.run(refusal_times_ms(address, prompts))
                cpu += tree_cpu_seconds(router.pid) - started_cpu
            print(f"{kind}: {len(times)} refused; router CPU {cpu / len(times) * 1000:.3f} ms "
                  f"per refusal; refusal ms p50 {np.percentile(times, 50):.1f} "
                  f"p99 {np.percentile(times, 99):.1f}; load {os.getloadavg()[0]:.1f}",
                  flush=True)
    finally:
        stop.set()
        holder.join(30)
        router.send_signal(signal.SIGINT)
        router.wait(20)
        worker.send("stop")
        worker_process.join(10)
        os.unlink(token_file.name)


if __name__ == "__main__":
    main()

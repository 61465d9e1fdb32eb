"""One benchmark run spread over several load-generator processes (`tandem bench --processes`).

A Python client process saturates a core at a few thousand streamed tokens a second, so a
router that relays more needs more of them. Process p of N takes every N-th request of the one
workload (global index i = local index * N + p, so warmup, prompts and lengths are those of a
single-process run), its share of the concurrency (closed loop) or 1/N of the rate (open loop:
the superposition of N independent Poisson streams of rate R/N is one of rate R; each process
draws its own arrivals) and of the measured requests. Records come back to the parent, whose
statistics cover them all; record times are time.perf_counter(), CLOCK_MONOTONIC on Linux, one
clock for every process of the host.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import multiprocessing

from tandem.bench.config import BenchmarkConfig
from tandem.bench.loadgen import LoadGenerator
from tandem.bench.records import RequestRecord


def count_of_index(total: int, num_processes: int, process: int) -> int:
    """How many of the global indices [0, total) process `process` of `num_processes` takes."""
    return max(0, (total - process + num_processes - 1) // num_processes)


def process_config(config: BenchmarkConfig, num_processes: int, process: int
                   ) -> BenchmarkConfig:
    """Process `process`'s share of `config` (one process, no progress line)."""
    warmup = count_of_index(config.warmup, num_processes, process)
    num_requests = None
    if config.num_requests is not None:
        num_requests = count_of_index(config.warmup + config.num_requests, num_processes,
                                      process) - warmup
    concurrency = rate = None
    if config.is_open_loop:
        rate = config.rate / num_processes
    else:
        total = config.max_in_flight
        concurrency = total // num_processes + (process < total % num_processes)
    return dataclasses.replace(config, processes=1, warmup=warmup, num_requests=num_requests,
                               concurrency=concurrency, rate=rate, show_progress=False)


def spread_records(config: BenchmarkConfig, client_options: dict, specs_factory
                   ) -> tuple[list[RequestRecord], bool]:
    """Runs `config` over config.processes processes; (every record, whether interrupted).
    `specs_factory()` gives the run's workload iterator (the same in every process)."""
    context = multiprocessing.get_context("spawn")
    num_processes = config.processes
    children = []
    for process in range(num_processes):
        receiver, sender = context.Pipe(duplex=False)
        child = context.Process(target=_run_share, daemon=True, args=(
            process_config(config, num_processes, process), client_options, specs_factory,
            num_processes, process, sender))
        child.start()
        children.append((child, receiver))
    records, interrupted = [], False
    for child, receiver in children:
        while True:
            try:
                child_records, child_interrupted = receiver.recv()
                break
            except KeyboardInterrupt:  # the children got SIGINT too: collect what they had
                interrupted = True
            except EOFError:  # the child died without answering
                child_records, child_interrupted = [], True
                break
        records += child_records
        interrupted = interrupted or child_interrupted
        child.join()
    return sorted(records, key=lambda record: record.index), interrupted


def _run_share(config: BenchmarkConfig, client_options: dict, specs_factory,
               num_processes: int, process: int, results) -> None:
    specs = itertools.islice(specs_factory(), process, None, num_processes)
    records, interrupted = [], False

    async def main() -> None:
        nonlocal records
        from tandem.bench.runner import open_client  # runner imports this module

        async with open_client(config, client_options) as client:
            generator = LoadGenerator(client, config, specs, arrival_stream=process)
            try:
                records = await generator.run()
            finally:
                records = records or list(generator.records)
    try:
        asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        interrupted = True
    for record in records:
        record.index = record.index * num_processes + process
    results.send(([r for r in records if r.error_code != "CANCELLED"], interrupted))

"""What cache-aware scoring costs the router per request: a microbenchmark.

    python -m tandem.bench.routing_overhead --workers 16 --blocks 100000 --prompt-len 2048

Fills a KVIndex with `--blocks` block hashes spread over `--workers` workers (each worker holds
the chains of prompts of its own plus a share of a few common system prompts), then times, per
request, (a) hashing the prompt into chained block hashes and (b) matching those against the
index and scoring every worker (RoutingPolicy.pick with the hashes already known). Prints p50
and p99 of each, in microseconds, of the thread's CPU time (time.thread_time_ns, which other
processes on a shared machine do not inflate) and of wall time (perf_counter_ns). The router's
total per-request time to compare with is its TTFT minus the worker's share (`tandem bench`).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from tandem.common.block_hash import prefix_block_hashes
from tandem.router.routing_policy import RoutingNote, RoutingPolicy
from tandem.v1 import worker_pb2


@dataclass(eq=False)
class _Worker:
    address: str
    role: str = "both"
    num_in_flight: int = 0
    load: worker_pb2.GetLoadResponse = field(default_factory=worker_pb2.GetLoadResponse)


def _fill(policy: RoutingPolicy, workers: list[_Worker], num_blocks: int, block_size: int,
          prompt_len: int, rng: random.Random) -> list[list[int]]:
    """Every worker gets whole prompt chains until the index holds num_blocks hashes; returns
    the common prefixes (system prompts) the requests are drawn from."""
    systems = [[rng.randrange(50_000) for _ in range(prompt_len // 2)] for _ in range(8)]
    per_worker = num_blocks // len(workers)
    for position, worker in enumerate(workers):
        hashes: dict[int, None] = {}  # ordered set: a chain's blocks stay together
        while len(hashes) < per_worker:
            prefix = systems[(position + len(hashes)) % len(systems)]
            tail = [rng.randrange(50_000) for _ in range(prompt_len - len(prefix))]
            hashes.update(dict.fromkeys(prefix_block_hashes(prefix + tail, block_size)))
        policy.index.apply(worker.address, worker_pb2.SubscribeKVEventsResponse(
            is_snapshot=True, block_size=block_size, stored_hashes=list(hashes)[:per_worker]))
    return systems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.routing_overhead",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--blocks", type=int, default=100_000, help="indexed block hashes in all")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    policy = RoutingPolicy("cache-aware")
    workers = [_Worker(f"10.0.0.{i}:7000", num_in_flight=rng.randrange(4))
               for i in range(args.workers)]
    systems = _fill(policy, workers, args.blocks, args.block_size, args.prompt_len, rng)
    clocks = {"cpu": time.thread_time_ns, "wall": time.perf_counter_ns}
    samples = {clock: ([], []) for clock in clocks}
    for request in range(2 * args.requests):
        clock_name = "cpu" if request % 2 == 0 else "wall"
        clock = clocks[clock_name]
        hash_ns, score_ns = samples[clock_name]
        system = rng.choice(systems)
        prompt = system + [rng.randrange(50_000) for _ in range(args.prompt_len - len(system))]
        note = RoutingNote()
        started = clock()
        note.prompt_hashes[args.block_size] = prefix_block_hashes(
            prompt, args.block_size, max_blocks=(len(prompt) - 1) // args.block_size)
        hashed = clock()
        policy.pick(workers, prompt, note)
        hash_ns.append(hashed - started)
        score_ns.append(clock() - hashed)
    print(f"{args.workers} workers, {policy.index.num_hashes} distinct indexed hashes "
          f"({sum(policy.index.num_blocks(w.address) for w in workers)} worker blocks), "
          f"{args.prompt_len}-token prompts, block size {args.block_size}, "
          f"{args.requests} requests")
    for clock_name, (hash_ns, score_ns) in samples.items():
        for name, values in (("hash prompt", hash_ns), ("match + score", score_ns),
                             ("total", [a + b for a, b in zip(hash_ns, score_ns)])):
            us = np.asarray(values) / 1e3
            print(f"{clock_name:<5}{name:<14} p50 {np.percentile(us, 50):8.1f} us   p99 "
                  f"{np.percentile(us, 99):8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())

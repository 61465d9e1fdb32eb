"""What cache-aware scoring costs the router per request: a microbenchmark.

    python -m tandem.bench.routing_overhead --workers 16 --blocks 100000 --prompt-len 2048

Fills a KVIndex with `--blocks` block hashes spread over `--workers` workers (each worker holds
the chains of prompts of its own plus a share of a few common system prompts), then times, per
request, RoutingPolicy.pick from the prompt's token ids: hashing the prompt's blocks that the
index match probes, matching and scoring every worker. Three kinds of request take turns:
  * "new tail": a common system prompt, then tokens no worker holds;
  * "next turn": a prompt one worker holds whole, whose first part (all but its last 96
    tokens) this router routed just before, as a conversation's next turn re-sends its history;
  * "held, unseen": a prompt one worker holds whole that this router has not seen (another
    router replica routed the conversation so far).
For reference it also times hashing every block of the prompt. Prints p50 and p99 in
microseconds of the thread's CPU time (time.thread_time_ns, which other processes on a shared
machine do not inflate) and of wall time (perf_counter_ns). The router's total per-request time
to compare with is its TTFT minus the worker's share (`tandem bench`).
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
    in_flight_at_load: int = 0
    load: worker_pb2.GetLoadResponse = field(default_factory=worker_pb2.GetLoadResponse)


def _fill(policy: RoutingPolicy, workers: list[_Worker], num_blocks: int, block_size: int,
          prompt_len: int, rng: random.Random) -> tuple[list[list[int]], list[list[int]]]:
    """Every worker gets whole prompt chains until the index holds num_blocks hashes; returns
    the common prefixes (system prompts) and the whole prompts some worker holds."""
    systems = [[rng.randrange(50_000) for _ in range(prompt_len // 2)] for _ in range(8)]
    per_worker = num_blocks // len(workers)
    held_prompts = []
    for position, worker in enumerate(workers):
        hashes: dict[int, None] = {}  # ordered set: a chain's blocks stay together
        while len(hashes) < per_worker:
            prefix = systems[(position + len(hashes)) % len(systems)]
            prompt = prefix + [rng.randrange(50_000) for _ in range(prompt_len - len(prefix))]
            hashes.update(dict.fromkeys(prefix_block_hashes(prompt, block_size)))
            if len(hashes) <= per_worker:
                held_prompts.append(prompt)
        policy.index.apply(worker.address, worker_pb2.SubscribeKVEventsResponse(
            is_snapshot=True, block_size=block_size, stored_hashes=list(hashes)[:per_worker]))
    return systems, held_prompts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.routing_overhead",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--blocks", type=int, default=100_000, help="indexed block hashes in all")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--requests", type=int, default=2000, help="of each kind, per clock")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    policy = RoutingPolicy("cache-aware")
    workers = [_Worker(f"10.0.0.{i}:7000", num_in_flight=rng.randrange(4))
               for i in range(args.workers)]
    systems, held_prompts = _fill(policy, workers, args.blocks, args.block_size,
                                  args.prompt_len, rng)
    clocks = {"cpu": time.thread_time_ns, "wall": time.perf_counter_ns}
    kinds = ("new tail", "next turn", "held, unseen")
    pick_ns = {(clock, kind): [] for clock in clocks for kind in kinds}
    hash_all_ns = {clock: [] for clock in clocks}
    for request in range(2 * len(kinds) * args.requests):
        clock_name = ("cpu", "wall")[request % 2]
        kind = kinds[request // 2 % len(kinds)]
        clock = clocks[clock_name]
        if kind == "new tail":
            system = rng.choice(systems)
            prompt = system + [rng.randrange(50_000)
                               for _ in range(args.prompt_len - len(system))]
        else:
            prompt = rng.choice(held_prompts)
            if kind == "next turn":
                policy.pick(workers, prompt[:-96], RoutingNote())
        started = clock()
        policy.pick(workers, prompt, RoutingNote())
        pick_ns[clock_name, kind].append(clock() - started)
        started = clock()
        prefix_block_hashes(prompt, args.block_size,
                            max_blocks=(len(prompt) - 1) // args.block_size)
        hash_all_ns[clock_name].append(clock() - started)
    print(f"{args.workers} workers, {policy.index.num_hashes} distinct indexed hashes "
          f"({sum(policy.index.num_blocks(w.address) for w in workers)} worker blocks), "
          f"{args.prompt_len}-token prompts, block size {args.block_size}, "
          f"{args.requests} requests of each kind")
    for clock_name in clocks:
        rows = [(f"pick, {kind}", pick_ns[clock_name, kind]) for kind in kinds]
        rows.append(("hash all blocks", hash_all_ns[clock_name]))
        for name, values in rows:
            us = np.asarray(values) / 1e3
            print(f"{clock_name:<5}{name:<20} p50 {np.percentile(us, 50):8.1f} us   p99 "
                  f"{np.percentile(us, 99):8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What cache-aware scoring costs the router per request: a microbenchmark.

    python -m tandem.bench.routing_overhead --workers 16 --blocks 100000 --prompt-len 2048

Fills a KVIndex with `--blocks` block hashes spread over `--workers` workers (each worker holds
whole prompts of its own, each starting with one of a few common system prompts of half the
prompt length, so several workers hold every system prompt), then times, per request,
RoutingPolicy.pick from the prompt's token ids as the router calls it (metrics on): hashing
the prefixes the index match probes, matching and scoring every worker. Three kinds of request
take turns:
  * "new tail": a common system prompt, then tokens no worker holds;
  * "next turn": a conversation's history that one worker holds (a prompt it holds whole, less
    its last `--new-tokens`), then that many new tokens nobody holds: that worker's prefix and
    the system prompt's other holders' both end inside the prompt, so matching bisects twice;
  * "held whole": a prompt one worker holds whole (the system prompt's other holders end
    halfway).
The router keeps nothing of a request for the next one, so each pick hashes afresh. Next to
them it times a least-loaded pick of the same workers: the part of a pick every policy pays,
which cache-aware scoring replaces (the scoring's added time is the difference; the whole
cache-aware pick bounds it from above). For reference it also times hashing every block of
the prompt one by one. Prints p50 and p99 in microseconds of the thread's CPU time
(time.thread_time_ns, which other processes on a shared machine do not inflate, though the
kernel's timer interrupts on this thread's core count) and of wall time (perf_counter_ns).
The router's whole per-request time to compare with comes from `python -m tandem.bench.router
--output-len 1`: with one token per request, its tokens per router CPU-second are requests.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import CollectorRegistry

from tandem.common.block_hash import prefix_block_hashes
from tandem.common.metrics import RouterMetrics
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
    """Every worker gets whole prompts until the index holds num_blocks hashes; returns the
    common prefixes (system prompts) and the whole prompts some worker holds."""
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
    p.add_argument("--new-tokens", type=int,
                   help="next turn: the new message's tokens after the held history (default "
                        "96, or a quarter of the prompt if less)")
    p.add_argument("--requests", type=int, default=2000, help="of each kind, per clock")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.new_tokens is None:
        args.new_tokens = min(96, args.prompt_len // 4)
    if not 0 < args.new_tokens < args.prompt_len // 2:
        p.error("--new-tokens must be above 0 and below half of --prompt-len")
    rng = random.Random(args.seed)
    policy = RoutingPolicy("cache-aware", metrics=RouterMetrics("bench", CollectorRegistry()))
    least_loaded = RoutingPolicy("least-loaded",
                                 metrics=RouterMetrics("bench", CollectorRegistry()))
    workers = [_Worker(f"10.0.0.{i}:7000", num_in_flight=rng.randrange(4))
               for i in range(args.workers)]
    systems, held_prompts = _fill(policy, workers, args.blocks, args.block_size,
                                  args.prompt_len, rng)
    clocks = {"cpu": time.thread_time_ns, "wall": time.perf_counter_ns}
    kinds = ("new tail", "next turn", "held whole")
    pick_ns = {(clock, kind): [] for clock in clocks for kind in kinds}
    least_loaded_ns = {clock: [] for clock in clocks}
    hash_all_ns = {clock: [] for clock in clocks}

    def new_tokens(count: int) -> list[int]:
        return [rng.randrange(50_000) for _ in range(count)]

    for request in range(2 * len(kinds) * args.requests):
        clock_name = ("cpu", "wall")[request % 2]
        kind = kinds[request // 2 % len(kinds)]
        clock = clocks[clock_name]
        if kind == "new tail":
            system = rng.choice(systems)
            prompt = system + new_tokens(args.prompt_len - len(system))
        elif kind == "next turn":
            prompt = rng.choice(held_prompts)[:-args.new_tokens] + new_tokens(args.new_tokens)
        else:
            prompt = rng.choice(held_prompts)
        started = clock()
        policy.pick(workers, prompt, RoutingNote())
        pick_ns[clock_name, kind].append(clock() - started)
        started = clock()
        least_loaded.pick(workers, prompt, RoutingNote())
        least_loaded_ns[clock_name].append(clock() - started)
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
        rows.append(("least-loaded pick", least_loaded_ns[clock_name]))
        rows.append(("hash all blocks", hash_all_ns[clock_name]))
        for name, values in rows:
            us = np.asarray(values) / 1e3
            print(f"{clock_name:<5}{name:<20} p50 {np.percentile(us, 50):8.1f} us   p99 "
                  f"{np.percentile(us, 99):8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())

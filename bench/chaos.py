"""Chaos run: steady greedy load on a `tandem up` stack while workers are SIGKILLed and
restarted, then the checks that nothing was lost.

    python -m tandem.bench.chaos [--model DIR] [--prefill 2 --decode 2 --both 0]
        [--duration 600] [--calm-seconds 60] [--kill-every 20] [--concurrency 4]

Known prompts (seeded token ids) run through the offline engine first (tandem.llm.LLM, same
checkpoint, float32) for their greedy references. Then `tandem up` starts and a closed loop
of `--concurrency` clients sends those prompts round robin (greedy, ignore_eos, max_tokens
fixed): `--calm-seconds` undisturbed, then `--duration` seconds in which every `--kill-every`
seconds a random worker is SIGKILLed and started again on its port, never the last worker of
its tier in the router's pool (a restart ends once the router has the worker back). At the
end it checks: no request failed, every output equals its reference, no worker holds a KV
block or a request, and no process grew by more than
`--max-rss-growth` (resident memory at the end of the calm phase against the end; a restarted
worker is compared with the process it replaced). It prints requests, migrations, ejections,
kills and p99 TTFT/TPOT of both phases; exit status 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np

from tandem.bench.up_stack import UpStack, is_serving
from tandem.client import TandemClient

__all__ = ["main"]
REQUEST_TIMEOUT_S = 300.0
IDLE_TIMEOUT_S = 30.0
POOL_TIMEOUT_S = 90.0


@dataclass(slots=True)
class Outcome:
    """One request: its phase ("calm" or "chaos"), prompt index, and how it ended."""
    phase: str
    prompt_index: int
    error: str = ""
    matches: bool = False
    num_migrations: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None


@dataclass(slots=True)
class Report:
    requests: dict = field(default_factory=dict)
    failed: list = field(default_factory=list)
    mismatched: int = 0
    migrations: int = 0
    router_migrations: float = 0.0
    ejections: float = 0.0
    kills: list = field(default_factory=list)
    latency: dict = field(default_factory=dict)
    busy_workers: dict = field(default_factory=dict)
    rss_mb: dict = field(default_factory=dict)
    rss_growth: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.chaos",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF checkpoint folder (default: the default model)")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--both", type=int, default=0)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of chaos")
    p.add_argument("--calm-seconds", type=float, default=60.0,
                   help="seconds of load before the first kill (the undisturbed latencies)")
    p.add_argument("--kill-every", type=float, default=20.0, help="seconds between kills")
    p.add_argument("--concurrency", type=int, default=4, help="clients in the closed loop")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 96], metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-kv-blocks", type=int,
                   help="passed to `tandem up` (on CPU a smaller cache restarts faster)")
    p.add_argument("--max-rss-growth", type=float, default=0.10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, help="children's logs (default: a temporary folder)")
    p.add_argument("--json", type=Path, help="write the report here")
    args = p.parse_args(argv)
    if args.prefill + args.decode + args.both < 2 or args.concurrency < 1:
        p.error("need two workers of a tier to kill one, and --concurrency >= 1")
    return args


def resolve_model(model: str | None) -> str:
    if model is not None:
        return str(Path(model).resolve())
    from tandem.common.default_model import default_cache_dir, ensure_default_model
    return str(ensure_default_model(default_cache_dir()))


def known_prompts(model: str, args: argparse.Namespace) -> list[list[int]]:
    """Seeded token-id prompts within the model's vocabulary (no tokenizer involved)."""
    vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    low, high = args.prompt_len
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(low, high))]
            for _ in range(args.num_prompts)]


def greedy_references(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from tandem import LLM, SamplingParams
    llm = LLM(model, dtype="float32")
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                       ignore_eos=True))
    finally:
        llm.shutdown()
    return [output.token_ids for output in outputs]


class Load:
    """A closed loop of clients sending the prompts round robin until `stop` is set."""

    def __init__(self, address: str, prompts: list[list[int]], references: list[list[int]],
                 max_tokens: int, concurrency: int) -> None:
        self.address, self.prompts, self.references = address, prompts, references
        self.max_tokens = max_tokens
        self.phase = "calm"
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self._next = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, daemon=True, name=f"client-{i}")
                         for i in range(concurrency)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(REQUEST_TIMEOUT_S + 10)

    def _client(self) -> None:
        with TandemClient(self.address, timeout=REQUEST_TIMEOUT_S) as client:
            while not self.stop.is_set():
                with self._lock:
                    index, self._next = self._next % len(self.prompts), self._next + 1
                    outcome = Outcome(self.phase, index)
                try:
                    result = client.generate(self.prompts[index], max_tokens=self.max_tokens,
                                             temperature=0.0, ignore_eos=True)
                    outcome.matches = result.token_ids == self.references[index]
                    outcome.num_migrations = int(result.usage.get("num_migrations", 0))
                    outcome.ttft_s = result.client_ttft_seconds
                    outcome.tpot_s = result.client_tpot_seconds
                except grpc.RpcError as exc:
                    outcome.error = f"{exc.code().name}: {exc.details()}"
                except Exception as exc:  # every failure is counted and reported
                    outcome.error = repr(exc)
                with self._lock:
                    self.outcomes.append(outcome)


def pick_victim(stack: UpStack, rng: random.Random):
    """A random worker whose tier keeps another worker serving and in the router's pool (a
    restarted worker may be serving yet still out of the pool for its ejection backoff), or
    None."""
    in_pool = stack.workers_in_pool()
    serving = [w for w in stack.workers if w.address in in_pool and is_serving(w.address)]
    candidates = [w for w in serving if sum(o.role == w.role for o in serving) >= 2]
    return rng.choice(candidates) if candidates else None


def run_chaos(stack: UpStack, duration: float, kill_every: float, rng: random.Random,
              kills: list[dict]) -> None:
    """Kill and restart a worker every `kill_every` seconds for `duration` seconds."""
    started = time.monotonic()
    next_kill = started
    while next_kill - started < duration:
        time.sleep(max(0.0, next_kill - time.monotonic()))
        next_kill += kill_every
        victim = pick_victim(stack, rng)
        if victim is None:
            kills.append({"at_s": round(time.monotonic() - started, 1), "skipped": True})
            continue
        at = time.monotonic() - started
        stack.kill(victim)
        stack.restart(victim)
        ready_s = stack.wait_serving(victim)
        in_pool_s = wait_in_pool(stack, victim.address, started + at)
        kills.append({"at_s": round(at, 1), "worker": victim.name,
                      "ready_after_s": round(ready_s, 1), "in_pool_after_s": in_pool_s})
        print(f"chaos: t={at:.0f} s killed {victim.name}, serving again after {ready_s:.1f} s, "
              f"in the router's pool after {in_pool_s} s", file=sys.stderr, flush=True)


def wait_in_pool(stack: UpStack, address: str, killed_at: float) -> float | None:
    """Seconds from the kill until the router has `address` back in its pool (its ejection
    backoff grows while the worker keeps failing), or None after POOL_TIMEOUT_S more."""
    deadline = time.monotonic() + POOL_TIMEOUT_S
    while address not in stack.workers_in_pool():
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)
    return round(time.monotonic() - killed_at, 1)


def p99(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.percentile(present, 99)) if present else None


def wait_idle(stack: UpStack) -> dict[str, str]:
    """Workers still busy after IDLE_TIMEOUT_S (running, waiting, pinned or KV in use)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        busy = {}
        for worker in stack.workers:
            load = stack.load(worker)
            if load.num_running or load.num_waiting or load.num_pinned or load.kv_usage:
                busy[worker.name] = (f"running={load.num_running} waiting={load.num_waiting} "
                                     f"pinned={load.num_pinned} kv_usage={load.kv_usage:g}")
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.5)


def summarize(report: Report, load: Load, rss_calm: dict, rss_end: dict,
              max_growth: float) -> None:
    for phase in ("calm", "chaos"):
        done = [o for o in load.outcomes if o.phase == phase]
        report.requests[phase] = len(done)
        report.latency[phase] = {"p99_ttft_s": p99([o.ttft_s for o in done]),
                                 "p99_tpot_s": p99([o.tpot_s for o in done])}
    report.failed = [f"{o.phase} prompt {o.prompt_index}: {o.error}"
                     for o in load.outcomes if o.error]
    report.mismatched = sum(not o.error and not o.matches for o in load.outcomes)
    report.migrations = sum(o.num_migrations for o in load.outcomes)
    report.rss_mb = {name: [round(rss_calm[name] / 2**20), round(rss_end[name] / 2**20)]
                     for name in rss_calm}
    report.rss_growth = {name: round(rss_end[name] / rss_calm[name] - 1, 3)
                         for name in rss_calm if rss_calm[name]}
    report.checks = {
        "no failed request": not report.failed,
        "every output equals its reference": report.mismatched == 0,
        "no KV block or request left on a worker": not report.busy_workers,
        f"no process grew by more than {max_growth:.0%}":
            all(g <= max_growth for g in report.rss_growth.values()),
        "load ran in both phases": report.requests["calm"] > 0 and report.requests["chaos"] > 0,
    }


def print_report(report: Report) -> None:
    def ms(value):
        return "-" if value is None else f"{value * 1000:.1f} ms"

    num_kills = sum(1 for k in report.kills if not k.get("skipped"))
    print(f"requests: {report.requests['calm']} calm, {report.requests['chaos']} during chaos; "
          f"failed {len(report.failed)}, outputs differing from the reference "
          f"{report.mismatched}")
    print(f"kills: {num_kills} (skipped {len(report.kills) - num_kills}); migrations "
          f"{report.migrations} (router counter {report.router_migrations:g}); ejections "
          f"{report.ejections:g}")
    for phase in ("calm", "chaos"):
        latency = report.latency[phase]
        print(f"{phase:<6} p99 TTFT {ms(latency['p99_ttft_s'])}, "
              f"p99 TPOT {ms(latency['p99_tpot_s'])}")
    print("RSS MB (end of calm -> end): " + ", ".join(
        f"{name} {a}->{b} ({report.rss_growth.get(name, 0):+.1%})"
        for name, (a, b) in report.rss_mb.items()))
    for failure in report.failed[:10]:
        print(f"  failed: {failure}")
    for name, busy in report.busy_workers.items():
        print(f"  still busy: {name} {busy}")
    for check, passed in report.checks.items():
        print(f"{'PASS' if passed else 'FAIL'}  {check}")


def main(argv=None) -> int:
    args = parse_args(argv)
    model = resolve_model(args.model)
    prompts = known_prompts(model, args)
    print(f"chaos: greedy references for {len(prompts)} prompts (offline engine)...",
          file=sys.stderr, flush=True)
    references = greedy_references(model, prompts, args.max_tokens)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="tandem-chaos-"))
    up_args = ["--model", model, "--prefill", str(args.prefill), "--decode", str(args.decode),
               "--both", str(args.both), "--dtype", "float32"]
    if args.num_kv_blocks is not None:
        up_args += ["--num-kv-blocks", str(args.num_kv_blocks)]
    stack = UpStack(up_args, log_dir)
    report = Report()
    try:
        print(f"chaos: stack up (logs in {log_dir}); {args.calm_seconds:g} s calm, "
              f"{args.duration:g} s of kills every {args.kill_every:g} s",
              file=sys.stderr, flush=True)
        load = Load(stack.router.address, prompts, references, args.max_tokens,
                    args.concurrency)
        load.start()
        time.sleep(args.calm_seconds)
        rss_calm = stack.rss()
        load.phase = "chaos"
        run_chaos(stack, args.duration, args.kill_every, random.Random(args.seed),
                  report.kills)
        load.join()
        report.busy_workers = wait_idle(stack)
        report.router_migrations = stack.router_counter("tandem:request_migrations")
        report.ejections = stack.router_counter("tandem:worker_ejections")
        summarize(report, load, rss_calm, stack.rss(), args.max_rss_growth)
    finally:
        stack.stop()
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    return 0 if all(report.checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

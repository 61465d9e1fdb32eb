"""The same load over the router's OpenAI HTTP API and over gRPC, in one run: what HTTP costs.

    python -m tandem.bench.http_vs_grpc                      # starts tandem up --both 1
    python -m tandem.bench.http_vs_grpc --concurrency 1,16 --rounds 3 --output-len 64
    python -m tandem.bench.http_vs_grpc --router 127.0.0.1:50051 --http http://127.0.0.1:8000

Without --router/--http it starts `tandem up --both 1 --http-port ... --no-prefix-caching`
(default model unless --model) and stops it at the end; a stack of your own should run without
prefix caching too, since both transports send the same prompts. For each concurrency it runs
`rounds` rounds of one gRPC and one HTTP run (tandem bench's load loop and clock for both;
which goes first alternates, so drift in a shared machine's load falls on both), each round
with prompts of its own seed. It prints per transport the mean and p50 TTFT and TPOT over every
measured request, output tokens/s, and CPU seconds per request of the router (when it started
the stack) and of this client, then the HTTP/gRPC ratios: of the pooled means, the median of
the rounds' own ratios (each round's two runs ran back to back, so a shared machine's changing
load cancels better there), and of the router's CPU time per request (what the HTTP layer
costs, unmoved by other processes' load). The targets bound what HTTP adds: TPOT at most 5%
and TTFT at most 10% over gRPC's (by the median of the rounds' ratios); an HTTP run faster than
gRPC's meets them. The exit status is 1 when a run had errors.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tandem.bench.config import BenchmarkConfig
from tandem.bench.report import latency_samples, summarize
from tandem.bench.proc_stats import process_cpu_seconds
from tandem.bench.runner import BenchmarkResult, async_run_benchmark
from tandem.bench.up_stack import UpStack
from tandem.common.ports import free_port

TARGETS = {"tpot_s": 0.05, "ttft_s": 0.10}  # |HTTP / gRPC - 1| at most
TRANSPORTS = ("grpc", "http")


@dataclasses.dataclass
class Target:
    """The router to measure: its gRPC address, its HTTP base URL and, when this process
    started it, its pid (for its CPU time)."""
    router: str
    http: str
    router_pid: int | None = None

    def router_cpu_s(self) -> float | None:
        return None if self.router_pid is None else process_cpu_seconds(self.router_pid)


@dataclasses.dataclass
class Run:
    result: BenchmarkResult
    router_cpu_s: float | None
    client_cpu_s: float


async def measure(stack: Target, base: BenchmarkConfig, concurrency: int,
                  rounds: int) -> dict[str, list[Run]]:
    """`rounds` gRPC and HTTP runs at `concurrency`, alternating which goes first."""
    runs: dict[str, list[Run]] = {name: [] for name in TRANSPORTS}
    for round_index in range(rounds):
        order = TRANSPORTS if round_index % 2 == 0 else TRANSPORTS[::-1]
        for name in order:
            config = dataclasses.replace(base, concurrency=concurrency,
                                         seed=base.seed + round_index,
                                         http=stack.http if name == "http" else None)
            router_before, client_before = stack.router_cpu_s(), time.process_time()
            result = await async_run_benchmark(config)
            router_after = stack.router_cpu_s()
            router_cpu = None if router_before is None or router_after is None \
                else router_after - router_before
            runs[name].append(Run(result, router_cpu, time.process_time() - client_before))
            print(f"http_vs_grpc: concurrency {concurrency}, round {round_index + 1}, {name}: "
                  f"{result.stats['num_ok']} ok, TPOT p50 "
                  f"{(result.stats['tpot_s']['p50'] or 0) * 1e3:.1f} ms", file=sys.stderr)
    return runs


def summarize_runs(runs: list[Run]) -> dict:
    """Latencies pooled over every measured request of `runs`; throughput and CPU per run."""
    records = [record for run in runs for record in run.result.records]
    samples = latency_samples(records)
    num_ok = sum(run.result.stats["num_ok"] for run in runs)
    num_errors = sum(run.result.stats["num_errors"] for run in runs)
    router_cpu = [run.router_cpu_s for run in runs]
    return {
        "num_ok": num_ok, "num_errors": num_errors,
        "ttft_s": summarize(samples["ttft_s"]), "tpot_s": summarize(samples["tpot_s"]),
        "output_token_throughput": sum(run.result.stats["output_token_throughput"] or 0
                                       for run in runs) / len(runs),
        "router_cpu_s_per_request": None if None in router_cpu or not num_ok
        else sum(router_cpu) / num_ok,
        "client_cpu_s_per_request": sum(run.client_cpu_s for run in runs) / max(1, num_ok),
    }


def _ratio(http_value: float | None, grpc_value: float | None) -> float | None:
    return http_value / grpc_value if grpc_value and http_value is not None else None


def round_ratios(runs: dict[str, list[Run]], key: str) -> list[float]:
    """Per round: HTTP's mean `key` over gRPC's, from that round's two runs."""
    out = []
    for grpc_run, http_run in zip(runs["grpc"], runs["http"]):
        ratio = _ratio(http_run.result.stats[key]["mean"], grpc_run.result.stats[key]["mean"])
        if ratio is not None:
            out.append(ratio)
    return out


def ratios(rows: dict[str, dict], runs: dict[str, list[Run]] | None = None) -> dict:
    """HTTP / gRPC of TTFT and TPOT (pooled means; the median of the rounds' ratios when
    `runs` are given, which decides) and whether HTTP adds at most the target; and of the
    router's CPU seconds per request."""
    out: dict = {}
    for key, target in TARGETS.items():
        pooled = _ratio(rows["http"][key]["mean"], rows["grpc"][key]["mean"])
        per_round = round_ratios(runs, key) if runs else []
        median = float(np.median(per_round)) if per_round else None
        verdict = median if runs else pooled
        out[key] = {"ratio": pooled, "median_round_ratio": median, "round_ratios": per_round,
                    "target": target, "ok": verdict is not None and verdict <= 1 + target}
    out["router_cpu"] = _ratio(rows["http"]["router_cpu_s_per_request"],
                               rows["grpc"]["router_cpu_s_per_request"])
    return out


def format_table(table: dict[int, dict]) -> str:
    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value * 1e3:.1f}"

    lines = [f"{'conc':>4} {'transport':<9} {'ok':>4} {'TTFT mean':>10} {'p50':>8} "
             f"{'TPOT mean':>10} {'p50':>8} {'tok/s':>7} {'router CPU':>11} {'client CPU':>11}",
             f"{'':>4} {'':<9} {'':>4} {'(ms)':>10} {'(ms)':>8} {'(ms)':>10} {'(ms)':>8} "
             f"{'':>7} {'(ms/req)':>11} {'(ms/req)':>11}"]
    for concurrency, entry in table.items():
        for name in TRANSPORTS:
            row = entry[name]
            lines.append(
                f"{concurrency:>4} {name:<9} {row['num_ok']:>4} {ms(row['ttft_s']['mean']):>10} "
                f"{ms(row['ttft_s']['p50']):>8} {ms(row['tpot_s']['mean']):>10} "
                f"{ms(row['tpot_s']['p50']):>8} {row['output_token_throughput']:>7.1f} "
                f"{ms(row['router_cpu_s_per_request']):>11} "
                f"{ms(row['client_cpu_s_per_request']):>11}")
        parts = []
        for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT")):
            r = entry["ratios"][key]
            median = r.get("median_round_ratio")
            value = "n/a" if r["ratio"] is None else f"{r['ratio']:.3f}"
            if median is not None:
                value += f", rounds' median {median:.3f}"
            parts.append(f"{label} {value} ({'meets' if r['ok'] else 'MISSES'} "
                         f"<= +{r['target']:.0%})")
        cpu = entry["ratios"].get("router_cpu")
        parts.append(f"router CPU {'n/a' if cpu is None else f'{cpu:.3f}'}")
        lines.append(f"{concurrency:>4} HTTP/gRPC {'; '.join(parts)}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.http_vs_grpc",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--router", metavar="HOST:PORT", help="a running router's gRPC address "
                   "(with --http; default: start tandem up --both 1)")
    p.add_argument("--http", metavar="URL", help="the same router's HTTP API")
    p.add_argument("--model", help="tandem up's --model (default: the default model)")
    p.add_argument("--concurrency", default="1,16", metavar="N1,N2,...")
    p.add_argument("--rounds", type=int, default=2, help="gRPC + HTTP runs per concurrency")
    p.add_argument("--num-requests", type=int, metavar="N",
                   help="measured requests per run (default max(8, 2 x concurrency))")
    p.add_argument("--input-len", default="128", metavar="DIST")
    p.add_argument("--output-len", default="64", metavar="DIST")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the table's numbers")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.router is None) != (args.http is None):
        print("http_vs_grpc: give --router and --http together (or neither)", file=sys.stderr)
        return 2
    concurrencies = [int(part) for part in args.concurrency.split(",") if part.strip()]
    up = None
    if args.router:
        stack = Target(args.router, args.http)
    else:
        http_port = free_port()
        up = UpStack(["--both", "1", "--http-port", str(http_port), "--no-prefix-caching",
                      *(["--model", args.model] if args.model else [])],
                     Path(tempfile.mkdtemp(prefix="tandem-http-vs-grpc-")))
        stack = Target(up.router.address, f"http://127.0.0.1:{http_port}", up.router.pid)
    table: dict[int, dict] = {}
    try:
        for concurrency in concurrencies:
            num_requests = args.num_requests or max(8, 2 * concurrency)
            base = BenchmarkConfig(router=stack.router, num_requests=num_requests,
                                   warmup=concurrency, input_len=args.input_len,
                                   output_len=args.output_len, seed=args.seed)
            runs = asyncio.run(measure(stack, base, concurrency, args.rounds))
            rows = {name: summarize_runs(runs[name]) for name in TRANSPORTS}
            table[concurrency] = {**rows, "ratios": ratios(rows, runs)}
    finally:
        if up is not None:
            up.stop()
    print(format_table(table), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({str(c): v for c, v in table.items()}, indent=2)
                                   + "\n", encoding="utf-8")
    has_errors = any(entry[name]["num_errors"] for entry in table.values() for name in TRANSPORTS)
    return 1 if has_errors else 0


if __name__ == "__main__":
    sys.exit(main())

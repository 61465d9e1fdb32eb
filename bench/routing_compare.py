"""Cache-aware routing against other policies on one workload, one stack per policy, in turn.

    python -m tandem.bench.routing_compare --both 3 --policies cache-aware,least-loaded \\
        -- --workload chat --conversations 12 --turns 6

For each policy: `tandem up --both N --routing POLICY` (default model unless --model), then
`tandem bench ARGS` against it, then the router's routing counters (decisions by reason,
predicted and actual cached tokens) and the CPU seconds every process of the stack used. The
report puts the policies side by side: cached prompt tokens against the ideal, TTFT p50.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.metrics_scrape import scrape
from tandem.common.ports import free_port

STARTUP_TIMEOUT_S = 600.0


def _start_stack(args: argparse.Namespace, policy: str, port: int, log_path: Path):
    """`tandem up` in its own session; returns it and {name: metrics host:port}."""
    command = [sys.executable, "-m", "tandem.cli", "up", "--both", str(args.both),
               "--routing", policy, "--port", str(port), *args.up_args]
    if args.model:
        command += ["--model", args.model]
    up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=open(log_path, "w"),
                          text=True, start_new_session=True)
    metrics = {}
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for line in up.stdout:
        match = re.match(r"\s+(\S+)\s+(\S+)\s+metrics http://(\S+)/metrics", line)
        if match:
            metrics[match.group(1)] = match.group(3)
        if line.startswith("Ctrl-C") or time.monotonic() > deadline:
            break
    if "router" not in metrics:
        up.kill()
        raise RuntimeError(f"tandem up did not start; see {log_path}")
    return up, metrics


def _samples(metrics_address: str) -> dict[str, float]:
    """Sums per sample name and `reason` label of the router's tandem: routing series."""
    sums: dict[str, float] = {}
    for sample in scrape(metrics_address, timeout=5):
        if "routing" in sample.name and not sample.name.endswith("_created"):
            key = sample.name + (f"{{{sample.labels['reason']}}}"
                                 if "reason" in sample.labels else "")
            sums[key] = sums.get(key, 0.0) + sample.value
    return sums


WORKER_SERIES = ("tandem:kv_transfer_bytes_total", "tandem:kv_transfer_seconds_count",
                 "tandem:prefix_cache_hits_total", "tandem:prefix_cache_queries_total")


def _worker_samples(metrics: dict[str, str]) -> dict[str, float]:
    """Sums per tier of the workers' KV transfer and prefix-cache counters."""
    sums: dict[str, float] = {}
    for name, address in metrics.items():
        if name == "router":
            continue
        for sample in scrape(address, timeout=5):
            if sample.name in WORKER_SERIES:
                key = f"{sample.name}{{{sample.labels.get('tier', '')}}}"
                sums[key] = sums.get(key, 0.0) + sample.value
    return sums


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants that are still running."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    pids, seen = [pid], set()
    while pids:
        current = pids.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{current}/task").iterdir():
                pids += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def run_policy(args: argparse.Namespace, policy: str, workdir: Path) -> dict:
    port = free_port()
    up, metrics = _start_stack(args, policy, port, workdir / f"up-{policy}.log")
    try:
        cpu_before = _cpu_seconds(up.pid)
        json_path = workdir / f"bench-{policy}.json"
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "tandem.cli", "bench", "--router",
                        f"127.0.0.1:{port}", "--no-progress", "--json", str(json_path),
                        *args.bench_args], check=True)
        wall_s = time.monotonic() - started
        stats = json.loads(json_path.read_text())["stats"]
        return {"policy": policy, "stats": stats,
                "routing": {**_samples(metrics["router"]), **_worker_samples(metrics)},
                "stack_cpu_s": _cpu_seconds(up.pid) - cpu_before, "wall_s": wall_s}
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)


def report(results: list[dict]) -> str:
    lines = [f"{'policy':<14}{'cached':>9}{'ideal':>9}{'x ideal':>9}{'hit rate':>10}"
             f"{'TTFT p50':>10}{'TTFT p90':>10}{'stack CPU s':>13}"]
    for result in results:
        stats = result["stats"]
        ideal = stats.get("ideal_cached_prompt_tokens") or 0
        cached = stats["total_cached_prompt_tokens"]
        lines.append(f"{result['policy']:<14}{cached:>9}{ideal:>9}"
                     f"{(cached / ideal if ideal else 0):>9.2f}"
                     f"{(stats['prefix_cache_hit_rate'] or 0) * 100:>9.1f}%"
                     f"{stats['ttft_s']['p50'] * 1e3:>8.0f}ms{stats['ttft_s']['p90'] * 1e3:>8.0f}ms"
                     f"{result['stack_cpu_s']:>13.1f}")
    for result in results:
        lines.append(f"{result['policy']}: " + ", ".join(
            f"{name.removeprefix('tandem:')}={value:g}"
            for name, value in sorted(result["routing"].items())))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m tandem.bench.routing_compare",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--both", type=int, default=3,
                   help="aggregated workers (default 3; 0 with --up-arg=--prefill ...)")
    p.add_argument("--policies", default="cache-aware,least-loaded")
    p.add_argument("--model", help="default: tandem up's default model")
    p.add_argument("--up-arg", dest="up_args", action="append", default=[],
                   help="one more argument for tandem up (repeat)")
    p.add_argument("--json", metavar="FILE", help="write every policy's stats and counters")
    args = p.parse_args(argv)
    args.bench_args = bench_args
    with tempfile.TemporaryDirectory(prefix="routing-compare-") as tmp:
        results = [run_policy(args, policy, Path(tmp)) for policy in args.policies.split(",")]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

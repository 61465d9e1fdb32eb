"""Decode step time of an 8B-shaped model with tensor parallelism, eager against CUDA graphs.

    python bench/probes/tp_decode.py [--tp 1,2] [--batches 1,8,32] [--context 1024]

Each (TP size, eager or graphs) engine runs in its own process (one process group each):
random bf16 weights built on the GPUs (load_format="dummy"), `batch` requests whose first
`context` tokens' KV is in place, then --steps engine steps timed on the host (scheduling,
the step, sampling: what a request's TPOT is made of). The table gives the median step per
batch and the graphs' speedup over eager at the same TP size. Needs as many GPUs as the
largest --tp.

--profile adds, for each graphs run, a torch.profiler trace of --profile-steps engine steps at
the first batch size on rank 0 (CPU and CUDA activity: the kernels its graph replays run, the
host work around them, gloo's broadcast of the step's inputs included), printed as two tables
after the main one: by GPU time and by host time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/probes/tp_decode.py")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--tp", default="1,2", help="TP sizes")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--child-timeout", type=float, default=300.0,
                   help="seconds one (TP size, mode) run may take")
    p.add_argument("--profile", action="store_true", help="profile rank 0's graphed steps")
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--one", help=argparse.SUPPRESS)  # "TP,eager|graphs,MODEL_DIR": a child run
    return p.parse_args(argv)


def run_one(args: argparse.Namespace) -> dict:
    """In a child process: one engine, every batch size; returns {batch: median step ms}."""
    from tandem.bench.engine import _install_prefilled
    from tandem.workers.engine.config import EngineConfig
    from tandem.workers.engine.engine import LLMEngine
    from tandem.workers.executor.executor import build_executor

    tp, mode, model_dir = args.one.split(",", 2)
    batches = [int(b) for b in args.batches.split(",")]
    config = EngineConfig(
        model=model_dir, dtype="bfloat16", load_format="dummy", kernels="aiter-triton",
        tensor_parallel_size=int(tp), enforce_eager=mode == "eager",
        max_model_len=args.context + args.steps + 16, max_num_seqs=max(batches),
        enable_prefix_caching=False)
    engine = LLMEngine(config, build_executor(config))
    gen = torch.Generator().manual_seed(0)
    result = {"graphed": engine.runner.graphs is not None, "ms": {}}
    try:
        for batch in batches:
            ids = _install_prefilled(engine, batch, args.context, gen)
            times = []
            for _ in range(args.steps):
                started = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - started)
            result["ms"][batch] = statistics.median(times[3:]) * 1e3
            if args.profile and result["graphed"] and "profile" not in result:
                result["profile"] = profile_steps(engine, batch, args.profile_steps)
            for request_id in ids:
                engine.abort(request_id)
    finally:
        engine.shutdown()
    return result


def profile_steps(engine, batch: int, steps: int) -> str:
    """Rank 0's view of `steps` engine steps: kernels by GPU time, host ops by CPU time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - started) / steps
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / steps / 1e3
    head = (f"batch {batch}, {steps} profiled steps: {wall * 1e3:.2f} ms per step (profiler "
            f"on), GPU kernels busy {gpu:.2f} ms per step")
    return "\n".join([head, events.table(sort_by="self_cuda_time_total", row_limit=15,
                                          max_name_column_width=60),
                      events.table(sort_by="self_cpu_time_total", row_limit=15,
                                   max_name_column_width=60)])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return 0
    sizes = [int(t) for t in args.tp.split(",")]
    if torch.cuda.device_count() < max(sizes):
        print(f"tp_decode: needs {max(sizes)} GPUs", file=sys.stderr)
        return 2
    from tandem.bench.engine_models import write_model_dir

    rows = []
    with tempfile.TemporaryDirectory() as root:
        model_dir = write_model_dir(args.model, Path(root))
        for tp in sizes:
            for mode in ("eager", "graphs"):
                try:
                    child = subprocess.run(
                        [sys.executable, __file__, "--batches",
                         args.batches, "--context", str(args.context), "--steps",
                         str(args.steps), "--profile-steps", str(args.profile_steps),
                         *(["--profile"] if args.profile else []),
                         "--one", f"{tp},{mode},{model_dir}"],
                        capture_output=True, text=True, timeout=args.child_timeout)
                except subprocess.TimeoutExpired as exc:
                    print(f"TP {tp} {mode}: no result in {args.child_timeout:g} s\n"
                          f"{(exc.stderr or b'')[-3000:]}", file=sys.stderr)
                    return 1
                lines = [ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")]
                if child.returncode or not lines:
                    print(child.stdout[-3000:], child.stderr[-3000:], file=sys.stderr)
                    return 1
                rows.append((tp, mode, json.loads(lines[-1][7:])))
                print(f"TP {tp} {mode} done", flush=True)
    print(f"\n{args.model}, bf16 random weights, context {args.context}; median engine step "
          f"(ms) of {args.steps}")
    print(f"{'TP':>3} {'mode':<7} {'graphed':<8} " + " ".join(f"{'bs ' + b:>9}"
                                                          for b in args.batches.split(",")))
    eager = {}
    for tp, mode, result in rows:
        ms = result["ms"]
        if mode == "eager":
            eager[tp] = ms
        cells = " ".join(f"{v:9.2f}" for v in ms.values())
        print(f"{tp:>3} {mode:<7} {str(result['graphed']):<8} {cells}")
        if mode == "graphs" and tp in eager:
            speedup = " ".join(f"{eager[tp][b] / v:8.2f}x" for b, v in ms.items())
            print(f"{'':>3} {'speedup':<7} {'':<8} {speedup}")
    for tp, mode, result in rows:
        if "profile" in result:
            print(f"\nTP {tp} {mode}, rank 0: {result['profile']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

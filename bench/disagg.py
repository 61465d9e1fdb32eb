"""Disaggregated against aggregated serving on the same two devices, same request stream.

    python -m tandem.bench.disagg --out disagg.json                 # 2 GPUs, Llama-3-8B shape
    python -m tandem.bench.disagg --model-path /models/llama --devices cuda:0,cuda:1
    python -m tandem.bench.disagg --cpu-smoke --out smoke.json      # tiny model on CPU, < 60 s

Layouts (each a router + workers started here as real processes on 127.0.0.1):
  disaggregated  1 prefill worker on the first device + 1 decode worker on the second; the
                 prompt's KV cache moves from one to the other through the workers' KV seam.
  aggregated     2 `--role both` workers, one per device; each request runs prefill and
                 decode on one worker (the router picks the least loaded), no KV moves.

Mixes: prefill-heavy (long prompts, short answers) and decode-heavy (short prompts, long
answers). For each mix and each Poisson rate, both layouts get the identical stream: the same
seed draws the same prompts, lengths and arrival times (bench/workload.py, bench/loadgen.py).
Every request runs to exactly max_tokens (min_tokens = max_tokens), so output lengths do not
depend on the random weights. The first --warmup requests of each run (JIT compiles, first
CUDA-graph replays) are not counted.

Measured per layout x mix x rate, at the client (bench/records.py): TTFT (send to first token)
and TPOT ((last - first token) / (tokens - 1)) p50/p90/p99, request and output-token
throughput, and goodput: successful requests per second that met TTFT <= --slo-ttft and TPOT <=
--slo-tpot, over the run's window (bench/report.py). Goodput, not throughput, is the number to
compare: both layouts are offered the same load, so they finish about the same requests per
second until one of them falls behind; what differs first is how many requests still meet the
latency targets. The headline is goodput(disaggregated) / goodput(aggregated) per mix, at each
rate and at the best rate of each layout.

What to expect, and why:
  * Aggregated: a worker runs prefill steps and decode steps in turn (a scheduler step is one
    or the other), so every prompt that arrives stalls the decodes in flight on that worker
    for the length of its prefill (tens of ms per 2k-token chunk on an H200 with an 8B model).
    With long prompts arriving often, TPOT p90/p99 grow with the prefill load, and TTFT queues
    behind both kinds of step. Both devices do both jobs, so all of the compute is used.
  * Disaggregated: decode steps are never interrupted by a prefill, so TPOT stays near the bare
    decode step time at the decode worker's batch size, and TTFT depends only on the prefill
    queue. The costs: (1) every request's KV moves between devices before its second token (on
    this branch over gRPC through host memory; ~128 KiB per token for Llama-3-8B in bf16, so
    a 3k-token prompt moves ~400 MB), which adds to the time between first and second token
    and can cap the request rate; (2) a fixed 1:1 split: on the prefill-heavy mix the decode
    device idles while one device does all the prefill work that two devices share in the
    aggregated layout, and on the decode-heavy mix it is the prefill device that idles. So
    disaggregation wins goodput where a tight TPOT SLO is what aggregated serving misses, and
    loses where raw prefill (or decode) capacity of one device is the limit.

Process logs go to a temporary folder, printed at the start and on failure, kept on failure or
with --keep-logs. Ctrl-C or SIGTERM stops the router, then the workers. The table is printed
last on stdout; --out writes everything as JSON (runs with full statistics, comparisons).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.config import BenchmarkConfig
from tandem.bench.disagg_stack import (LocalStack, StackFailure, build_tiny_checkpoint,
                                       write_tokenizer)
from tandem.bench.runner import BenchmarkError, run_benchmark

__all__ = ["LAYOUTS", "MIXES", "build_parser", "compare_runs", "format_report",
           "goodput_ratio", "main", "run_row"]
LAYOUTS = ("disaggregated", "aggregated")
MIXES = ("prefill-heavy", "decode-heavy")
# Defaults per mode; a flag given on the command line wins. Sized for 2 H200s and an 8B model:
# two stack starts (~1 min each with CUDA-graph capture) and 8 runs of 80 requests, ~6 min.
DEFAULTS = {
    "gpu": {"devices": "cuda:0,cuda:1", "dtype": "bfloat16", "kernels": "auto",
            "max_model_len": 8192, "num_kv_blocks": 20000, "max_num_seqs": 128,
            "num_requests": 80, "warmup": 4, "request_timeout": 60.0,
            "prefill_heavy_input": "uniform:2000:4000", "prefill_heavy_output": "uniform:32:64",
            "prefill_heavy_rates": "2,4", "decode_heavy_input": "uniform:100:300",
            "decode_heavy_output": "uniform:300:600", "decode_heavy_rates": "4,8"},
    "smoke": {"devices": "cpu,cpu", "dtype": "float32", "kernels": "torch",
              "max_model_len": 256, "num_kv_blocks": 256, "max_num_seqs": 8,
              "num_requests": 3, "warmup": 0, "request_timeout": 30.0,
              "prefill_heavy_input": "uniform:48:96", "prefill_heavy_output": "uniform:2:3",
              "prefill_heavy_rates": "20", "decode_heavy_input": "uniform:4:8",
              "decode_heavy_output": "uniform:10:16", "decode_heavy_rates": "20"},
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.disagg",
                                description=__doc__.splitlines()[0],
                                epilog="Lengths: N, uniform:A:B or normal:MU:SIGMA (tokens).")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", default="llama3-8b",
                       help="a bench/engine_models.py shape with random weights (load-format "
                            "dummy; default llama3-8b)")
    model.add_argument("--model-path", type=Path, help="a real HF checkpoint folder instead")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny transformers-built checkpoint on CPU, tiny lengths, few requests")
    p.add_argument("--devices", metavar="D0,D1",
                   help="the two devices: prefill,decode (disaggregated); one aggregated worker "
                        "on each (default cuda:0,cuda:1; cpu,cpu with --cpu-smoke)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="default: both")
    p.add_argument("--mixes", default=",".join(MIXES), help="default: both")
    for mix in MIXES:
        flag = f"--{mix}"
        p.add_argument(f"{flag}-input", metavar="DIST", help=f"{mix} prompt lengths")
        p.add_argument(f"{flag}-output", metavar="DIST", help=f"{mix} output lengths")
        p.add_argument(f"{flag}-rates", metavar="R1,R2", help=f"{mix} Poisson rates (req/s)")
    p.add_argument("--num-requests", type=int, help="measured requests per run")
    p.add_argument("--warmup", type=int, help="uncounted requests before each run")
    p.add_argument("--request-timeout", type=float, metavar="S",
                   help="deadline of each request (an overloaded run still ends)")
    p.add_argument("--slo-ttft", type=float, default=2.0, metavar="S", help="default 2 s")
    p.add_argument("--slo-tpot", type=float, default=0.05, metavar="S", help="default 0.05 s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype")
    p.add_argument("--kernels")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--num-kv-blocks", type=int, help="KV blocks per worker (16 tokens each)")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--worker-args", default="", help="extra worker flags, one shell string")
    p.add_argument("--ready-timeout", type=float, default=600.0, metavar="S")
    p.add_argument("--keep-logs", action="store_true", help="keep the log folder on success")
    p.add_argument("--out", type=Path, help="write the results as JSON")
    return p


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fills the flags left unset from DEFAULTS["smoke" or "gpu"]."""
    for key, value in DEFAULTS["smoke" if args.cpu_smoke else "gpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.device_list = [d.strip() for d in args.devices.split(",")]
    if len(args.device_list) != 2:
        raise SystemExit(f"--devices: expected two devices, got {args.devices!r}")
    args.layout_list = _names(args.layouts, LAYOUTS, "--layouts")
    args.mix_list = _names(args.mixes, MIXES, "--mixes")
    args.mix_rates = {}
    for mix in args.mix_list:
        text = getattr(args, f"{mix.replace('-', '_')}_rates")
        args.mix_rates[mix] = [float(r) for r in text.split(",") if r.strip()]
    return args


def _names(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise SystemExit(f"{flag}: {text!r}: choose from {', '.join(allowed)}")
    return names


def _prepare_model(args: argparse.Namespace, run_dir: Path) -> tuple[Path, list[str]]:
    """The model folder and its load flags."""
    if args.cpu_smoke and args.model_path is None:
        return build_tiny_checkpoint(run_dir / "tiny-llama"), []
    if args.model_path is not None:
        return args.model_path, []
    from tandem.bench.engine_models import write_model_dir

    path = write_model_dir(args.model, run_dir)
    write_tokenizer(path)
    return path, ["--load-format", "dummy"]


def _worker_args(args: argparse.Namespace, load_flags: list[str]) -> list[str]:
    import shlex

    flags = [*load_flags, "--dtype", args.dtype, "--kernels", args.kernels,
             "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs)]
    if args.num_kv_blocks:
        flags += ["--num-kv-blocks", str(args.num_kv_blocks)]
    return flags + shlex.split(args.worker_args)


def layout_workers(layout: str, devices: list[str]) -> list[tuple[str, str]]:
    """(role, device) of each worker of a layout."""
    if layout == "disaggregated":
        return [("prefill", devices[0]), ("decode", devices[1])]
    return [("both", devices[0]), ("both", devices[1])]


def run_row(stats: dict) -> dict:
    """What the table shows of one run's compute_stats: latencies in ms, rates per second."""
    def ms(key: str) -> dict:
        return {p: (None if stats[key][p] is None else stats[key][p] * 1e3)
                for p in ("p50", "p90", "p99")}

    goodput = stats["goodput"] or {}
    return {"ttft_ms": ms("ttft_s"), "tpot_ms": ms("tpot_s"),
            "request_throughput": stats["request_throughput"],
            "output_token_throughput": stats["output_token_throughput"],
            "goodput": goodput.get("requests_per_s"), "num_good": goodput.get("num_good"),
            "num_ok": stats["num_ok"], "num_errors": stats["num_errors"]}


def goodput_ratio(disaggregated: float | None, aggregated: float | None) -> float | None:
    """disaggregated / aggregated goodput; None when undefined (a missing value, or aggregated
    0: no finite ratio says "aggregated met nothing")."""
    if disaggregated is None or aggregated is None or aggregated <= 0:
        return None
    return disaggregated / aggregated


def compare_runs(runs: list[dict]) -> dict:
    """Per mix: the ratio at each rate run in both layouts, and the ratio of each layout's best
    goodput over its rates. `runs` items: {"layout", "mix", "rate", "row"}."""
    comparison: dict = {}
    for mix in dict.fromkeys(run["mix"] for run in runs):
        by_key = {(r["layout"], r["rate"]): r["row"] for r in runs if r["mix"] == mix}
        rates = sorted({rate for _, rate in by_key})
        per_rate = {}
        for rate in rates:
            disagg, agg = by_key.get(("disaggregated", rate)), by_key.get(("aggregated", rate))
            if disagg and agg:
                per_rate[f"{rate:g}"] = goodput_ratio(disagg["goodput"], agg["goodput"])
        best = {layout: max((row["goodput"] or 0.0 for (lay, _), row in by_key.items()
                             if lay == layout), default=None) for layout in LAYOUTS}
        comparison[mix] = {"goodput_ratio_by_rate": per_rate,
                           "best_goodput": best,
                           "goodput_ratio_best": goodput_ratio(best["disaggregated"],
                                                               best["aggregated"])}
    return comparison


def _fmt(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def format_report(result: dict) -> str:
    """The fixed-width table: one line per mix x rate x layout, then the goodput ratios."""
    config = result["config"]
    header = (f"{'mix':<14}{'rate':>6} {'layout':<14}{'TTFT p50':>9}{'p90':>7}{'p99':>7}"
              f"{'TPOT p50':>9}{'p90':>6}{'p99':>6}{'req/s':>7}{'tok/s':>8}{'goodput':>8}"
              f"{'good':>9}{'err':>4}")
    title = (f" Disaggregated vs aggregated: {result['model']} on {config['devices']}; SLO TTFT "
             f"<= {config['slo_ttft'] * 1e3:g} ms, TPOT <= {config['slo_tpot'] * 1e3:g} ms "
             "(latencies ms) ")
    lines = [title.center(len(header), "="), header]
    for run in result["runs"]:
        row = run["row"]
        lines.append(
            f"{run['mix']:<14}{run['rate']:>6g} {run['layout']:<14}"
            f"{_fmt(row['ttft_ms']['p50']):>9}{_fmt(row['ttft_ms']['p90']):>7}"
            f"{_fmt(row['ttft_ms']['p99']):>7}{_fmt(row['tpot_ms']['p50'], 1):>9}"
            f"{_fmt(row['tpot_ms']['p90'], 1):>6}{_fmt(row['tpot_ms']['p99'], 1):>6}"
            f"{_fmt(row['request_throughput'], 2):>7}{_fmt(row['output_token_throughput']):>8}"
            f"{_fmt(row['goodput'], 2):>8}{row['num_good']!s:>5}/{row['num_ok']:<3}"
            f"{row['num_errors']:>4}")
    lines.append("-" * len(header))
    for mix, comp in result["comparison"].items():
        by_rate = ", ".join(f"{rate} req/s: {_ratio(ratio)}"
                            for rate, ratio in comp["goodput_ratio_by_rate"].items()) or "n/a"
        lines.append(f"goodput disaggregated/aggregated, {mix}: best rate "
                     f"{_ratio(comp['goodput_ratio_best'])} ({by_rate})")
    lines.append("=" * len(header))
    return "\n".join(lines)


def run(args: argparse.Namespace, run_dir: Path) -> dict:
    """Every layout x mix x rate; returns the JSON-ready result."""
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    model_dir, load_flags = _prepare_model(args, run_dir)
    worker_args = _worker_args(args, load_flags)
    env = {"OMP_NUM_THREADS": "1"} if args.cpu_smoke else {}
    runs, model_info = [], {}
    for layout in args.layout_list:
        stack = LocalStack(layout, model_dir, layout_workers(layout, args.device_list), log_dir,
                           worker_args=worker_args, env=env, ready_timeout_s=args.ready_timeout,
                           router_args=["--max-model-len", str(args.max_model_len)])
        _log(f"{layout}: starting {stack.workers} ...")
        router = stack.start()
        _log(f"{layout}: router {router} ready")
        try:
            for mix in args.mix_list:
                key = mix.replace("-", "_")
                for rate in args.mix_rates[mix]:
                    _log(f"{layout} / {mix} / {rate:g} req/s ...")
                    result = run_benchmark(BenchmarkConfig(
                        router=router, rate=rate, num_requests=args.num_requests,
                        warmup=args.warmup, input_len=getattr(args, f"{key}_input"),
                        output_len=getattr(args, f"{key}_output"), seed=args.seed,
                        slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                        timeout_s=args.request_timeout, show_progress=True))
                    stack.check_alive()
                    model_info = result.model_info
                    runs.append({"layout": layout, "mix": mix, "rate": rate,
                                 "row": run_row(result.stats), "stats": result.stats})
        finally:
            stack.stop()
            _log(f"{layout}: stopped")
    config = {k: v for k, v in vars(args).items() if k not in ("model_path", "out")}
    config.update(model_path=str(args.model_path) if args.model_path else None,
                  devices=",".join(args.device_list), worker_args_resolved=worker_args)
    return {"model": model_info.get("model", model_dir.name), "model_info": model_info,
            "config": config, "runs": runs, "comparison": compare_runs(runs)}


_T0 = time.monotonic()


def _log(message: str) -> None:
    print(f"[disagg {time.monotonic() - _T0:6.1f} s] {message}", file=sys.stderr, flush=True)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = _resolve(build_parser().parse_args(argv))
    run_dir = Path(tempfile.mkdtemp(prefix="tandem-disagg-"))
    _log(f"logs and model config under {run_dir}")
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM cleans up like Ctrl-C
    try:
        result = run(args, run_dir)
    except KeyboardInterrupt:
        _log(f"interrupted; processes stopped; logs kept in {run_dir / 'logs'}")
        return 130
    except (StackFailure, BenchmarkError, ValueError, OSError) as exc:
        _log(f"failed: {exc}\nlogs kept in {run_dir / 'logs'}")
        return 1
    except Exception:
        _log(f"failed; logs kept in {run_dir / 'logs'}")
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2, default=str))
    if not args.keep_logs:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(format_report(result))
    return 0 if all(run["row"]["num_ok"] for run in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())

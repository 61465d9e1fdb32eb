"""Disaggregated against aggregated serving on the same two devices: goodput under SLOs.

    python -m tandem.bench.disagg --quick --out disagg.json   # 2 H200s, Llama-3-8B shape, ~6 min
    python -m tandem.bench.disagg --out disagg.json           # the same, finer (~15 min)
    python -m tandem.bench.disagg --cpu-smoke --out smoke.json   # tiny model on CPU, ~1 min

Layouts (each a router + workers started here as real processes on 127.0.0.1, once per
layout and reused for every mix and rate; 8B-shaped bf16 random weights, load-format dummy):
  disaggregated  1 prefill worker on the first device + 1 decode worker on the second; the
                 prompt's KV moves between them (--kv-transfer auto: cuda-ipc on one host).
  aggregated     2 `--role both` workers, one per device; the router picks the less loaded.

Mixes: prefill-heavy (prompts 2000-4000 tokens, 32-64 out) and decode-heavy (100-300 in,
128-256 out). Each stack is warmed up on both mixes first (JIT, CUDA graphs, KV paths).

Goodput (bench/disagg_sweep.py) is DistServe's SLO-attainment goodput: the highest Poisson
rate at which >= --attainment (90%) of the requests meet TTFT <= --slo-ttft and TPOT <=
--slo-tpot (failed requests miss), interpolated between the last passing and the first failing
rate. The TTFT SLO (1 s: >10x an H200's bare TTFT of a 4k-token prompt) is also what reveals
overload in a short run, as a growing queue. Per layout x mix an adaptive sweep finds the
goodput: from --<mix>-start-rate the rate grows by --rate-factor while runs pass the loosest
SLO reported, then the bracket is refined once; it stops early when the next run would overrun
--sweep-seconds (the goodput is then a lower bound, ">="). A run sends max(--min-requests,
rate x --run-seconds) requests after --warmup uncounted ones, each to max_tokens (min_tokens =
max_tokens); prompts are seeded by mix and rate, so both layouts get the identical stream at a
rate and no run hits another's prefix cache. Workers are idle before each run. Before the
sweeps each stack gets a closed-loop warm-up and --settle-runs uncounted runs per mix at its
first rate (a stack's first loaded run can be slower than its later ones).

The report: one line per run (SLO attainment, "kept up" = completions / arrivals over the run's
second half, TTFT/TPOT percentiles, CPU share of the router and of this client process: near
100% means Python, not the GPUs, is the limit), then per mix each layout's goodput and the ratio
disaggregated / aggregated for each TPOT SLO of --tpot-grid plus --slo-tpot (all from the same
runs), then how long each phase took. --out writes every run with per-request samples.

What to expect: the scheduler is prefill-first, so on an aggregated worker every arriving prompt
stalls the decodes in flight for its prefill (~50 ms per 2k-token chunk, 8B on an H200): TPOT
grows with the prefill load while both GPUs share the prefill work. Disaggregated decodes are
never interrupted, but one GPU does all the prefill (prefill-heavy) or all the decode
(decode-heavy). So disaggregation wins where a tight TPOT SLO is what aggregated serving misses,
and loses where one device's raw capacity is the limit: the TPOT grid shows where the ratio
crosses 1. Short runs show overload late: a throughput-bound goodput may be overrated by up to
TTFT SLO / (0.9 x --run-seconds), 14% with --quick (printed with the table; disagg_sweep.py).
Process logs go to a temporary folder (kept on failure or with --keep-logs).
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.config import BenchmarkConfig
from tandem.bench.disagg_report import format_report, run_row, summarize
from tandem.bench.disagg_stack import (LocalStack, StackFailure, build_tiny_checkpoint,
                                       write_tokenizer)
from tandem.bench.disagg_sweep import RatePoint, RateSweep, attainment, kept_up, samples_of
from tandem.bench.runner import BenchmarkError, run_benchmark

__all__ = ["LAYOUTS", "MIXES", "build_parser", "layout_workers", "main", "resolve"]
LAYOUTS = ("disaggregated", "aggregated")
MIXES = ("prefill-heavy", "decode-heavy")
_GPU = {"devices": "cuda:0,cuda:1", "dtype": "bfloat16", "kernels": "auto",
        "max_model_len": 8192, "num_kv_blocks": 20000, "max_num_seqs": 128,
        "prefill_heavy_input": "uniform:2000:4000", "prefill_heavy_output": "uniform:32:64",
        "decode_heavy_input": "uniform:100:300", "decode_heavy_output": "uniform:128:256",
        "request_timeout": 30.0, "warmup_requests": 8, "settle_runs": 1}
# Defaults per preset; a flag given on the command line wins.
DEFAULTS = {
    "gpu": {**_GPU, "prefill_heavy_start_rate": 4.0, "decode_heavy_start_rate": 8.0,
            "rate_factor": 1.4, "run_seconds": 15.0, "min_requests": 30, "warmup": 4,
            "sweep_seconds": 180.0},
    # Sized for 2 H200s: model folder, 2 x (stack start, warm-up, settle runs, stop) ~2 min,
    # and 4 sweeps of <= 65 s (+ the last run's overshoot): ~6-7 min in all.
    "quick": {**_GPU, "prefill_heavy_start_rate": 5.0, "decode_heavy_start_rate": 12.0,
              "rate_factor": 1.6, "run_seconds": 8.0, "min_requests": 16, "warmup": 2,
              "sweep_seconds": 65.0},
    "smoke": {"devices": "cpu,cpu", "dtype": "float32", "kernels": "torch",
              "max_model_len": 256, "num_kv_blocks": 256, "max_num_seqs": 8,
              "prefill_heavy_input": "uniform:48:96", "prefill_heavy_output": "uniform:2:3",
              "decode_heavy_input": "uniform:4:8", "decode_heavy_output": "uniform:10:16",
              "request_timeout": 20.0, "warmup_requests": 2, "settle_runs": 0,
              "prefill_heavy_start_rate": 4.0, "decode_heavy_start_rate": 4.0,
              "rate_factor": 2.0, "run_seconds": 1.5, "min_requests": 4, "warmup": 0,
              "sweep_seconds": 4.0},
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
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true", help="the ~6 min preset (2 H200s)")
    preset.add_argument("--cpu-smoke", action="store_true",
                        help="tiny transformers-built checkpoint on CPU, tiny lengths and runs")
    p.add_argument("--devices", metavar="D0,D1",
                   help="the two devices: prefill,decode (disaggregated); one aggregated worker "
                        "on each (default cuda:0,cuda:1; cpu,cpu with --cpu-smoke)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="default: both")
    p.add_argument("--mixes", default=",".join(MIXES), help="default: both")
    for mix in MIXES:
        flag = f"--{mix}"
        p.add_argument(f"{flag}-input", metavar="DIST", help=f"{mix} prompt lengths")
        p.add_argument(f"{flag}-output", metavar="DIST", help=f"{mix} output lengths")
        p.add_argument(f"{flag}-start-rate", type=float, metavar="R",
                       help=f"{mix}: the sweep's first Poisson rate (req/s)")
        p.add_argument(f"{flag}-rates", metavar="R1,R2",
                       help=f"{mix}: run exactly these rates instead of the adaptive sweep")
    p.add_argument("--rate-factor", type=float, help="the sweep's step up (x)")
    p.add_argument("--run-seconds", type=float, metavar="S", help="arrival window of one run")
    p.add_argument("--min-requests", type=int, help="measured requests per run, at least")
    p.add_argument("--warmup", type=int, help="uncounted requests before each run")
    p.add_argument("--warmup-requests", type=int, help="per mix, once per stack, before runs")
    p.add_argument("--settle-runs", type=int, metavar="N",
                   help="uncounted open-loop runs at each mix's first rate, once per stack")
    p.add_argument("--sweep-seconds", type=float, metavar="S",
                   help="time allowance of one layout x mix sweep")
    p.add_argument("--request-timeout", type=float, metavar="S",
                   help="deadline of each request (an overloaded run still ends)")
    p.add_argument("--slo-ttft", type=float, default=1.0, metavar="S", help="default 1 s")
    p.add_argument("--slo-tpot", type=float, default=0.05, metavar="S", help="default 0.05 s")
    p.add_argument("--tpot-grid", default="0.01,0.015,0.025,0.05", metavar="S1,S2",
                   help="TPOT SLOs (s) for the sensitivity table (the --slo-tpot is added)")
    p.add_argument("--attainment", type=float, default=0.9, help="SLO attainment target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype")
    p.add_argument("--kernels")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--num-kv-blocks", type=int, help="KV blocks per worker (16 tokens each)")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--router-processes", type=int, metavar="N",
                   help="`tandem router --processes N` (default: the router's own default); "
                        "the report's router column is the CPU of all of them, in cores")
    p.add_argument("--worker-args", default="", help="extra worker flags, one shell string")
    p.add_argument("--ready-timeout", type=float, default=600.0, metavar="S")
    p.add_argument("--keep-logs", action="store_true", help="keep the log folder on success")
    p.add_argument("--out", type=Path, help="write the results as JSON")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fills the flags left unset from the preset's DEFAULTS; parses the lists."""
    preset = "smoke" if args.cpu_smoke else "quick" if args.quick else "gpu"
    args.preset = preset
    for key, value in DEFAULTS[preset].items():
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
        args.mix_rates[mix] = [float(r) for r in text.split(",") if r.strip()] if text else None
    args.tpot_list = sorted({float(t) for t in args.tpot_grid.split(",") if t.strip()}
                            | {args.slo_tpot})
    if not 0 < args.attainment <= 1 or args.rate_factor <= 1:
        raise SystemExit("--attainment must be in (0, 1] and --rate-factor > 1")
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


def _lengths(args, mix: str) -> tuple[str, str]:
    key = mix.replace("-", "_")
    return getattr(args, f"{key}_input"), getattr(args, f"{key}_output")


def _start_rate(args, mix: str) -> float:
    return getattr(args, f"{mix.replace('-', '_')}_start_rate")


def _warm_up(args, router: str) -> None:
    """Every mix's shapes once through the stack (JIT compiles, graph replays, KV moves)."""
    for mix in args.mix_list:
        input_len, _ = _lengths(args, mix)
        run_benchmark(BenchmarkConfig(
            router=router, concurrency=4, num_requests=args.warmup_requests,
            input_len=input_len, output_len="8", seed=args.seed + MIXES.index(mix),
            timeout_s=args.ready_timeout))


def _settle(args, stack: LocalStack, router: str) -> None:
    """--settle-runs uncounted runs per mix at its first rate. The closed-loop warm-up does
    not load a stack like an open-loop run: on 2 H200s the first measured run of the
    disaggregated stack had a TTFT p90 of 1.5-1.7 s where later, faster runs had 0.3 s,
    which alone set the goodput."""
    for _ in range(args.settle_runs):
        for mix in args.mix_list:
            rate = (args.mix_rates[mix] or [_start_rate(args, mix)])[0]
            run = run_once(args, stack, router, mix, rate, seed_offset=7 * 10**6)  # unused seeds
            _log(f"settle run, {mix} / {rate:.3g} req/s (not counted): "
                 f"{run['row']['attainment']:.0%} met the SLO")


def run_once(args, stack: LocalStack, router: str, mix: str, rate: float,
             seed_offset: int = 0) -> dict:
    """One open-loop run at `rate` on an idle stack: its row and per-request samples."""
    input_len, output_len = _lengths(args, mix)
    if not stack.wait_idle():
        _log("workers still busy after 30 s; running anyway")
    cpu_before, client_before = stack.router_cpu_seconds(), _client_cpu_seconds()
    started = time.monotonic()
    result = run_benchmark(BenchmarkConfig(
        router=router, rate=rate, num_requests=max(args.min_requests,
                                                   math.ceil(rate * args.run_seconds)),
        warmup=args.warmup, input_len=input_len, output_len=output_len,
        seed=args.seed + seed_offset + 10**6 * (1 + MIXES.index(mix))  # disjoint per run
        + round(rate * 1000),
        slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot, timeout_s=args.request_timeout,
        show_progress=True))
    seconds = time.monotonic() - started
    stack.check_alive()
    cpu_after = stack.router_cpu_seconds()
    samples = samples_of(result.records)
    row = run_row(result.stats)
    row.update(attainment=attainment(samples, args.slo_ttft, args.slo_tpot), seconds=seconds,
               kept_up=kept_up(result.records),
               client_cpu=(_client_cpu_seconds() - client_before) / seconds,
               router_cpu=None if cpu_before is None or cpu_after is None
               else (cpu_after - cpu_before) / seconds)
    return {"rate": rate, "row": row, "stats": result.stats, "samples": samples,
            "model_info": result.model_info}


def sweep(args, stack: LocalStack, router: str, layout: str, mix: str) -> list[dict]:
    """The adaptive sweep (or the explicit --<mix>-rates) of one layout x mix."""
    explicit = args.mix_rates[mix]
    queue = list(explicit or [])
    rates = RateSweep(start=_start_rate(args, mix),
                      factor=args.rate_factor, stop_slo=(args.slo_ttft, max(args.tpot_list)),
                      target=args.attainment)
    runs, points, started = [], [], time.monotonic()
    while True:
        if explicit is not None:
            if not queue:
                break
            rate = queue.pop(0)
        else:
            rate = rates.next_rate(points)
            if rate is None:
                break
            longest = max((p.seconds for p in points), default=0.0)
            if points and time.monotonic() - started + longest > args.sweep_seconds:
                _log(f"{layout} / {mix}: next run would pass --sweep-seconds "
                     f"{args.sweep_seconds:g}; stopping")
                break
        _log(f"{layout} / {mix} / {rate:.3g} req/s ...")
        run = run_once(args, stack, router, mix, rate)
        run.update(layout=layout, mix=mix)
        runs.append(run)
        points.append(RatePoint(rate, run["samples"], run["row"]["seconds"]))
        kept = run["row"]["kept_up"]
        _log(f"{layout} / {mix} / {rate:.3g} req/s: {run['row']['attainment']:.0%} met the "
             f"SLO, kept up {'n/a' if kept is None else f'{kept:.0%}'}, "
             f"{run['row']['seconds']:.1f} s")
    return runs


def run(args: argparse.Namespace, run_dir: Path) -> dict:
    """Every layout x mix sweep; returns the JSON-ready result."""
    phases: list[tuple[str, float]] = []
    clock = time.monotonic()

    def phase(name: str) -> None:
        nonlocal clock
        now = time.monotonic()
        phases.append((name, now - clock))
        clock = now

    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    model_dir, load_flags = _prepare_model(args, run_dir)
    worker_args = _worker_args(args, load_flags)
    env = {"OMP_NUM_THREADS": "1"} if args.cpu_smoke else {}
    runs, model_info = [], {}
    phase("model folder")
    for layout in args.layout_list:
        stack = LocalStack(layout, model_dir, layout_workers(layout, args.device_list), log_dir,
                           worker_args=worker_args, env=env, ready_timeout_s=args.ready_timeout,
                           router_args=["--max-model-len", str(args.max_model_len)]
                           + ([] if args.router_processes is None
                              else ["--processes", str(args.router_processes)]))
        _log(f"{layout}: starting {stack.workers} ...")
        router = stack.start()
        phase(f"{layout}: start")
        try:
            _warm_up(args, router)
            _settle(args, stack, router)
            phase(f"{layout}: warm-up")
            for mix in args.mix_list:
                runs += sweep(args, stack, router, layout, mix)
                model_info = runs[-1]["model_info"] if runs else model_info
                count = sum(r["mix"] == mix and r["layout"] == layout for r in runs)
                phase(f"{layout} / {mix}: {count} runs")
        finally:
            stack.stop()
            _log(f"{layout}: stopped")
        phase(f"{layout}: stop")
    config = {k: v for k, v in vars(args).items() if k not in ("model_path", "out")}
    config.update(model_path=str(args.model_path) if args.model_path else None,
                  devices=",".join(args.device_list), worker_args_resolved=worker_args)
    for r in runs:
        r.pop("model_info", None)
    return {"model": model_info.get("model", model_dir.name), "model_info": model_info,
            "config": config, "runs": runs, "summary": summarize(runs, args),
            "phases": phases}


def _client_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


_T0 = time.monotonic()


def _log(message: str) -> None:
    print(f"[disagg {time.monotonic() - _T0:6.1f} s] {message}", file=sys.stderr, flush=True)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = resolve(build_parser().parse_args(argv))
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
        args.out.write_text(json.dumps(result, indent=1, default=str))
    if not args.keep_logs:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(format_report(result))
    cells = {(r["layout"], r["mix"]) for r in result["runs"]}
    served = {(r["layout"], r["mix"]) for r in result["runs"] if r["row"]["num_ok"]}
    return 0 if cells and served == cells else 1  # 1: some layout x mix served nothing


if __name__ == "__main__":
    sys.exit(main())

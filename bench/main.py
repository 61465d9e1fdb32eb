"""`tandem bench`: load-test a Tandem router and report latency, throughput and goodput.

    tandem bench --router 127.0.0.1:50051 --concurrency 8 --num-requests 200 \\
        --input-len uniform:16:512 --output-len 128 --json bench.json --plot bench.png
    tandem bench --rates 1,2,4,8 --duration 60 --slo-ttft 0.5 --slo-tpot 0.05 --plot sweep.png
    tandem bench --http http://127.0.0.1:8000 --concurrency 16   # the OpenAI HTTP API instead

Progress goes to stderr; the summary table goes to stdout, last. The exit status is 1 when the
benchmark could not run or a run had no successful request. Ctrl-C stops the run: the table and
the JSON cover the requests that had finished, and the exit status is 130.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tandem.bench.config import DEFAULT_NUM_REQUESTS, WORKLOADS, BenchmarkConfig
from tandem.bench.report import format_sweep_table
from tandem.bench.runner import (BenchmarkError, BenchmarkInterrupted, BenchmarkResult,
                                 run_benchmark, run_sweep, sweep_to_json)
from tandem.client_flags import add_client_flags, client_security

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem bench", description="Load-test a Tandem router (tandem.v1.Generate).",
        epilog="Lengths: N, uniform:A:B (inclusive) or normal:MU:SIGMA (rounded, >= 1).")
    p.add_argument("--router", default="127.0.0.1:50051", metavar="HOST:PORT")
    p.add_argument("--http", metavar="URL",
                   help="drive the router's OpenAI-compatible HTTP API at URL "
                        "(http(s)://host:port, from `tandem up --http-port`) instead of gRPC: "
                        "streamed /v1/completions, same workloads and report")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--concurrency", type=int, metavar="N",
                       help="closed loop: N requests always in flight (default 1)")
    shape.add_argument("--rate", type=float, metavar="R",
                       help="open loop: Poisson arrivals at R requests/s")
    shape.add_argument("--rates", metavar="R1,R2,...",
                       help="a sweep: one open-loop run per Poisson rate")
    p.add_argument("--num-requests", type=int, metavar="N",
                   help=f"measured requests per run (default {DEFAULT_NUM_REQUESTS} unless "
                        "--duration)")
    p.add_argument("--duration", type=float, metavar="S",
                   help="stop starting requests S seconds after the first measured one")
    p.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="requests sent first and not counted")
    p.add_argument("--input-len", default="128", metavar="DIST",
                   help="synthetic prompt length in tokens (default 128)")
    p.add_argument("--output-len", default="128", metavar="DIST",
                   help="max_tokens of each request (default 128)")
    p.add_argument("--prompts-file", metavar="FILE.jsonl",
                   help='prompts instead of synthetic ones: lines {"prompt": ...} or '
                        '{"messages": [...]}, optional "max_tokens"')
    p.add_argument("--allow-early-stop", action="store_true",
                   help="let EOS end a request early (default: min_tokens = max_tokens)")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    p.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    p.add_argument("--slo-ttft", type=float, metavar="SECONDS", help="goodput's TTFT bound")
    p.add_argument("--slo-tpot", type=float, metavar="SECONDS", help="goodput's TPOT bound")
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="deadline of each request")
    p.add_argument("--json", metavar="FILE", help="write config, stats and per-request records")
    p.add_argument("--plot", metavar="FILE.png", help="write latency CDFs (and sweep curves)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument("--processes", type=int, default=1, metavar="N",
                   help="spread the requests over N load-generator processes, so the generator "
                        "is not the bottleneck (its CPU share is in the report; with N > 1 "
                        "there is no progress line)")
    _add_workload_flags(p)
    add_client_flags(p)
    return p


def _add_workload_flags(p: argparse.ArgumentParser) -> None:
    shared = p.add_argument_group("shared-prefix workloads (the report shows the prefix cache "
                                  "hit rate: cached / prompt tokens, and against the ideal)")
    shared.add_argument("--workload", choices=WORKLOADS, default="random",
                        help="random prompts (default); chat: multi-turn conversations "
                             "re-sending their history; shared-prefix: groups of prompts "
                             "sharing a long prefix")
    shared.add_argument("--conversations", type=int, default=12, metavar="C",
                        help="chat: concurrent conversations (default 12)")
    shared.add_argument("--turns", type=int, default=6, metavar="T",
                        help="chat: turns per conversation (default 6)")
    shared.add_argument("--system-prompt-len", type=int, default=256, metavar="S",
                        help="chat: tokens of each conversation's system prompt (default 256); "
                             "--input-len is each user message")
    shared.add_argument("--shared-system-prompt", action="store_true",
                        help="chat: every conversation starts with the same system prompt "
                             "(default: each conversation has its own)")
    shared.add_argument("--think-time", type=float, default=0.0, metavar="SECONDS",
                        help="chat: mean pause between a reply and the next turn "
                             "(exponential; default 0: the next turn follows at once)")
    shared.add_argument("--groups", type=int, default=4, metavar="G",
                        help="shared-prefix: prompt groups (default 4)")
    shared.add_argument("--prefix-len", type=int, default=512, metavar="P",
                        help="shared-prefix: tokens of each group's prefix (default 512); "
                             "--input-len is each request's suffix")


def _config(args: argparse.Namespace) -> BenchmarkConfig:
    return BenchmarkConfig(
        router=args.router, http=args.http, concurrency=args.concurrency, rate=args.rate,
        num_requests=args.num_requests, duration_s=args.duration, warmup=args.warmup,
        input_len=args.input_len, output_len=args.output_len, prompts_file=args.prompts_file,
        allow_early_stop=args.allow_early_stop, temperature=args.temperature, seed=args.seed,
        slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot, timeout_s=args.timeout,
        show_progress=not args.no_progress, processes=args.processes,
        workload=args.workload,
        conversations=args.conversations, turns=args.turns,
        system_prompt_len=args.system_prompt_len,
        shared_system_prompt=args.shared_system_prompt, groups=args.groups,
        prefix_len=args.prefix_len, think_time_s=args.think_time)


def _parse_rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--rates: {text!r} is not a comma-separated list of numbers") from None
    if not rates or min(rates) <= 0:
        raise ValueError(f"--rates: {text!r}: give one or more rates > 0")
    return rates


def _write_outputs(args: argparse.Namespace, results: list[BenchmarkResult],
                   rates: list[float] | None) -> None:
    if args.json:
        text = results[0].to_json() if rates is None else sweep_to_json(rates, results)
        Path(args.json).write_text(text + "\n", encoding="utf-8")
        print(f"tandem bench: wrote {args.json}", file=sys.stderr)
    if args.plot:
        from tandem.bench.plot import plot_results

        plot_results(results, args.plot)
        print(f"tandem bench: wrote {args.plot}", file=sys.stderr)


def _check_outputs_possible(args: argparse.Namespace) -> None:
    """Fail before the run, not after it, when an output cannot be written."""
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"--plot needs matplotlib ({exc}); pip install matplotlib "
                             "(or drop --plot)") from None
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path and not Path(path).expanduser().resolve().parent.is_dir():
            raise ValueError(f"{flag} {path}: its folder does not exist")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    interrupted = False
    try:
        rates = _parse_rates(args.rates) if args.rates else None
        config = _config(args)
        client_options = client_security(args)
        _check_outputs_possible(args)
        try:
            results = (run_sweep(config, rates, client_options) if rates
                       else [run_benchmark(config, client_options)])
        except BenchmarkInterrupted as exc:
            interrupted, results = True, exc.results
            rates = rates[:len(results)] if rates else None
            print("tandem bench: interrupted; reporting the requests that finished",
                  file=sys.stderr)
        _write_outputs(args, results, rates)
    except (BenchmarkError, ValueError, OSError, RuntimeError) as exc:
        print(f"tandem bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tandem bench: interrupted", file=sys.stderr)
        return 130
    tables = [result.table() for result in results]
    if rates:
        tables.append(format_sweep_table(rates, [result.stats for result in results]))
    print("\n\n".join(tables), flush=True)
    if interrupted:
        return 130
    return 0 if all(result.stats["num_ok"] > 0 for result in results) else 1

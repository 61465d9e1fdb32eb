"""What users get through the router against what the engine and the GPU allow, in one run.

    python -m tandem.bench.serve --out serve.json        # one GPU, llama3-8b shape, ~6 min
    python -m tandem.bench.serve --cpu-smoke              # tiny model on CPU: the plumbing only

Order, on one GPU, each phase holding the device alone:
  1. limits: copy bandwidth (the decode floor's denominator) and the bf16 matmul rate;
  2. engine: an LLMEngine on random weights times one CUDA-graph replay (model step) and a whole
     `LLMEngine.step()` (engine step: schedule, inputs, replay, sampling) at batch 1 / 8 / 64
     with 1024 tokens of context (bench/engine.py's decode case);
  3. served: `tandem up --both 1` on the same model with default worker flags (dummy weights,
     bench/disagg_stack.py's byte tokenizer), then `tandem bench` at concurrency 1 and 64
     (1024-token prompts, 256 output tokens, every request to its max_tokens);
  4. offline: `LLM.generate` of the very requests the concurrency-64 run sent (same token ids,
     same lengths), default engine flags (max_num_seqs 64, the same bound as the served run).

The table printed last: served TPOT at c=1 as a ratio to the decode floor and to the model
step; engine step / model step per batch; served c=64 output tok/s as a ratio to offline
`LLM.generate`; TTFT p50 / p99; the KV blocks the worker chose. --out keeps the JSON.
--cpu-smoke runs phases 3 and 4 on a 2-layer model on the CPU (no limits, no engine timing):
it checks the benchmark runs end to end, its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.config import BenchmarkConfig
from tandem.bench.disagg_stack import build_tiny_checkpoint, write_tokenizer
from tandem.bench.engine import in_child
from tandem.bench.runner import run_benchmark
from tandem.bench.up_stack import UpStack
from tandem.bench.workload import synthetic_workload

__all__ = ["main"]
MODEL = "llama3-8b"


def _log(message: str) -> None:
    print(f"[serve {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def measure_engine(model_dir: Path, batches: list[int], context: int, steps: int,
                   async_scheduling: bool | None = None) -> dict:
    """Limits, then model step / engine step / floor per batch (bench/engine.py's decode case).
    Run it in_child."""
    from tandem.bench.engine import bench_decode, build_engine
    from tandem.bench.engine_limits import measure_limits, shape_of

    limits = measure_limits()
    _log(f"limits: {limits.as_dict()}")
    engine = build_engine(model_dir, argparse.Namespace(
        batches=batches, contexts=[context], steps=steps, prefill=[], kernels="aiter-triton",
        gpu_memory_utilization=0.9, async_scheduling=async_scheduling))
    for cache in engine.runner.kv_caches:
        for tensor in cache:
            tensor.uniform_(-1, 1)  # random KV: never time on zeros
    shape = shape_of(engine.model, engine.hf_config)
    rows = {}
    for batch in batches:
        rows[batch] = bench_decode(engine, shape, limits, batch, context, steps)
        _log(f"decode {batch}x{context}: {rows[batch]}")
    engine.shutdown()
    return {"limits": limits.as_dict(), "decode": rows}


def measure_served(model_dir: Path, args: argparse.Namespace, up_args: list[str],
                   log_dir: Path) -> dict:
    """Warm-up, then concurrency 1 and concurrency --concurrency through the router."""
    command = ["--model", str(model_dir), "--both", "1", *up_args]
    _log("starting: tandem up " + " ".join(command))
    stack = UpStack(command, log_dir, omp_num_threads=None)
    try:
        blocks = sum(sample.value for sample in
                     stack.samples(stack.workers[0], "tandem:num_kv_blocks"))
        _log(f"worker KV blocks: {blocks}")
        common = dict(router=stack.router.address, input_len=str(args.input_len),
                      output_len=str(args.output_len), timeout_s=args.request_timeout)
        run_benchmark(BenchmarkConfig(**{**common, "output_len": "8"}, concurrency=8,
                                      num_requests=16, seed=10**6))  # JIT, graphs, KV paths
        runs = {}
        for concurrency, num_requests in ((1, args.c1_requests),
                                          (args.concurrency, args.num_requests)):
            result = run_benchmark(BenchmarkConfig(**common, concurrency=concurrency,
                                                   num_requests=num_requests, seed=args.seed,
                                                   show_progress=True))
            print(result.table(), file=sys.stderr, flush=True)
            runs[concurrency] = result
        return {"kv_blocks": blocks, "runs": runs}
    finally:
        stack.stop()


def measure_offline(model_dir: Path, model_info: dict, args: argparse.Namespace,
                    engine_args: dict) -> dict:
    """LLM.generate of the requests the concurrency-N run sent (the same seed and draw). Run it
    in_child on a GPU, so that no other engine's memory is held."""
    from tandem.common.sampling_params import SamplingParams
    from tandem.llm import LLM
    from tandem.bench.workload import LengthDist

    specs = synthetic_workload(LengthDist.parse(str(args.input_len)),
                               LengthDist.parse(str(args.output_len)),
                               vocab_size=model_info["vocab_size"],
                               eos_token_ids=model_info["eos_token_ids"],
                               max_model_len=model_info["max_model_len"], seed=args.seed)
    requests = [next(specs) for _ in range(args.num_requests)]
    prompts = [list(spec.token_ids) for spec in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=spec.max_tokens,
                             min_tokens=spec.max_tokens) for spec in requests]
    with LLM(model_dir, **engine_args) as llm:
        llm.generate(prompts[:8], [SamplingParams(temperature=0.0, max_tokens=8)] * 8)  # warm-up
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - started
    tokens = sum(len(out.token_ids) for out in outputs)
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_per_s": tokens / seconds}


def build_report(engine: dict | None, served: dict, offline: dict, concurrency: int) -> dict:
    """The ratios the table shows, from the phases' raw results."""
    c1 = served["runs"][1].stats
    cn = served["runs"][concurrency].stats
    report = {"served_c1_tpot_ms": c1["tpot_s"]["p50"] * 1e3,
              f"served_c{concurrency}_output_tok_per_s": cn["output_token_throughput"],
              f"served_c{concurrency}_ttft_ms": {"p50": cn["ttft_s"]["p50"] * 1e3,
                                                 "p99": cn["ttft_s"]["p99"] * 1e3},
              f"served_c{concurrency}_tpot_ms_p50": cn["tpot_s"]["p50"] * 1e3,
              "offline_output_tok_per_s": offline["output_tok_per_s"],
              "served_over_offline": cn["output_token_throughput"] / offline["output_tok_per_s"],
              "kv_blocks": served["kv_blocks"],
              "failed": c1["num_errors"] + cn["num_errors"]}
    if engine is not None:
        one = engine["decode"][1]
        report["floor_bs1_ms"] = one["floor_ms"]
        report["model_step_bs1_ms"] = one["model_step_ms"]
        report["served_c1_over_floor"] = report["served_c1_tpot_ms"] / one["floor_ms"]
        report["served_c1_over_model_step"] = report["served_c1_tpot_ms"] / one["model_step_ms"]
        report["engine_over_model_step"] = {
            str(batch): row["engine_step_ms"] / row["model_step_ms"]
            for batch, row in engine["decode"].items() if "skipped" not in row}
    return report


def format_table(report: dict, concurrency: int) -> str:
    lines = ["figure                                          value"]

    def row(name: str, value: str) -> None:
        lines.append(f"{name:<47} {value}")

    if "floor_bs1_ms" in report:
        row("decode floor, batch 1", f"{report['floor_bs1_ms']:.2f} ms")
        row("model step, batch 1", f"{report['model_step_bs1_ms']:.2f} ms")
        for batch, ratio in report["engine_over_model_step"].items():
            row(f"engine step / model step, batch {batch}", f"{ratio:.2f}x")
        row("served TPOT p50, c=1", f"{report['served_c1_tpot_ms']:.2f} ms "
            f"({report['served_c1_over_floor']:.2f}x floor, "
            f"{report['served_c1_over_model_step']:.2f}x model step)")
    else:
        row("served TPOT p50, c=1", f"{report['served_c1_tpot_ms']:.2f} ms")
    n = concurrency
    row(f"served output tok/s, c={n}", f"{report[f'served_c{n}_output_tok_per_s']:.0f} "
        f"({report['served_over_offline']:.2f}x offline LLM.generate "
        f"{report['offline_output_tok_per_s']:.0f})")
    ttft = report[f"served_c{n}_ttft_ms"]
    row(f"served TTFT p50 / p99, c={n}", f"{ttft['p50']:.0f} / {ttft['p99']:.0f} ms")
    row(f"served TPOT p50, c={n}", f"{report[f'served_c{n}_tpot_ms_p50']:.2f} ms")
    row("worker KV blocks (default flags)", f"{report['kv_blocks']:.0f}"
        if report["kv_blocks"] is not None else "unknown")
    row("failed requests", str(report["failed"]))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny model on the CPU, small load: checks the plumbing only")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=256,
                        help="requests of the concurrency run (and of offline LLM.generate)")
    parser.add_argument("--c1-requests", type=int, default=12,
                        help="requests of the concurrency-1 run")
    parser.add_argument("--batches", default="1,8,64", help="engine-step batches")
    parser.add_argument("--steps", type=int, default=12, help="engine steps timed per batch")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--up-args", default="",
                        help="extra `tandem up` flags (default: none, the defaults are the point)")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="every phase reads each step's tokens before queueing the next "
                             "(the engine's default on a GPU is asynchronous scheduling)")
    parser.add_argument("--out", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    import shlex

    args = build_parser().parse_args(argv)
    if args.cpu_smoke:
        args.input_len, args.output_len = min(args.input_len, 48), min(args.output_len, 16)
        args.concurrency, args.num_requests = min(args.concurrency, 4), min(args.num_requests, 8)
        args.c1_requests = min(args.c1_requests, 2)
    with tempfile.TemporaryDirectory() as root:
        root = Path(root)
        if args.cpu_smoke:
            model_dir = build_tiny_checkpoint(root / "tiny-llama")
            load_flags, engine_args, engine = [], {"dtype": "float32"}, None
        else:
            import torch
            if not torch.cuda.is_available():
                print("bench/serve.py needs a CUDA or ROCm GPU (or --cpu-smoke)", file=sys.stderr)
                return 2
            from tandem.bench.engine_models import write_model_dir

            model_dir = write_model_dir(MODEL, root)
            write_tokenizer(model_dir)
            load_flags = ["--load-format", "dummy"]
            engine_args = {"load_format": "dummy"}
            batches = [int(b) for b in args.batches.split(",") if b]
            engine = in_child(measure_engine, model_dir, batches, args.input_len, args.steps,
                              False if args.no_async_scheduling else None)
        if args.no_async_scheduling:
            load_flags.append("--no-async-scheduling")
            engine_args["async_scheduling"] = False
        served = measure_served(model_dir, args, load_flags + shlex.split(args.up_args), root)
        model_info = served["runs"][args.concurrency].model_info
        offline = in_child(measure_offline, model_dir, model_info, args, engine_args)
        _log(f"offline LLM.generate: {offline}")
    report = build_report(engine, served, offline, args.concurrency)
    if args.out:
        args.out.write_text(json.dumps({
            "report": report, "engine": engine, "offline": offline,
            "served": {str(c): r.to_dict() for c, r in served["runs"].items()}}, indent=1))
    print(format_table(report, args.concurrency))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

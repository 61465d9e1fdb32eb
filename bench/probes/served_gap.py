"""Where a served token's time goes beyond the engine step, at concurrency 1 on one GPU.

    python -m tandem.bench.probes.served_gap [--tokens 256] [--out gap.json]

One greedy request (1024 prompt tokens, --tokens output tokens) on the llama3-8b shape with
dummy weights, its time per output token measured four ways, each on the GPU alone:
  1. engine: `LLMEngine.step()` in a loop (what bench/engine.py's engine step times);
  2. async engine: the same engine behind `AsyncEngine`, tokens read from its stream on an
     asyncio loop (the worker's engine thread and event loop, no gRPC);
  3. the same with the worker's metrics recorder observing every step;
  4. served: `tandem up --both 1` and one request through the router (client-side TPOT), with
     the worker's own `tandem:engine_step_seconds` over that request (its engine loop's pace).
The differences locate the served overhead: 1->2 the engine thread / event loop hand-off,
2->3 metrics, 3->4 the servicer, gRPC and the router.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

CONTEXT = 1024


def _engine(model_dir: Path, tokens: int):
    import torch

    from tandem.workers.engine.config import EngineConfig
    from tandem.workers.engine.engine import LLMEngine
    from tandem.workers.executor.executor import build_executor

    on_gpu = torch.cuda.is_available()
    config = EngineConfig(model=str(model_dir), dtype="bfloat16" if on_gpu else "float32",
                          load_format="dummy", max_model_len=CONTEXT + tokens + 64,
                          max_num_seqs=8)
    return LLMEngine(config, build_executor(config))


def _params(tokens: int):
    from tandem.common.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens)


def measure_in_process(model_dir: Path, tokens: int) -> dict:
    """Phases 1-3 (run it in_child: the engine's GPU memory goes with the process)."""
    import torch

    from tandem.common.metrics import WorkerMetrics
    from tandem.workers.async_engine import AsyncEngine
    from tandem.workers.metrics_recorder import WorkerMetricsRecorder

    engine = _engine(model_dir, tokens)
    prompt = torch.randint(0, engine.resolved.vocab_size, (CONTEXT,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    results = {"async_scheduling": engine.async_scheduling}

    def engine_loop(request_id: str) -> float:
        engine.add_request(prompt, _params(tokens), request_id)
        stamps = []
        while engine.has_unfinished:
            if engine.step():
                stamps.append(time.perf_counter())
        return (stamps[-1] - stamps[1]) / (len(stamps) - 2)  # decode tokens only

    engine_loop("warm-up")
    results["engine_ms"] = engine_loop("engine") * 1e3
    # The same loop again, split into the host's own time and its wait for the device, and
    # profiled per function (printed to stderr).
    import cProfile
    import pstats

    from tandem.workers.engine.sampler import DeviceSample

    waited = []
    original = DeviceSample.to_host

    def timed_to_host(self):
        started = time.perf_counter()
        try:
            return original(self)
        finally:
            waited.append(time.perf_counter() - started)

    DeviceSample.to_host = timed_to_host
    profile = cProfile.Profile()
    profile.enable()
    per_token = engine_loop("profiled")
    profile.disable()
    DeviceSample.to_host = original
    results["engine_profiled_ms"] = per_token * 1e3
    results["engine_device_wait_ms"] = sum(waited[2:]) / max(1, len(waited) - 2) * 1e3
    pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(25)

    async def streamed(request_id: str, on_step) -> float:
        runner = AsyncEngine(engine, on_step=on_step)
        runner.start()
        try:
            stream = runner.open_stream(request_id)
            await runner.call(lambda e: e.add_request(prompt, _params(tokens), request_id))
            stamps = []
            while True:
                event = await stream.get()
                stamps.append(time.perf_counter())
                if event.finish_reason is not None:
                    break
            return (stamps[-1] - stamps[1]) / (len(stamps) - 2)
        finally:
            await runner.stop()

    results["async_engine_ms"] = asyncio.run(streamed("async", None)) * 1e3
    from prometheus_client import CollectorRegistry

    recorder = WorkerMetricsRecorder(engine, WorkerMetrics(str(model_dir), "both",
                                                           CollectorRegistry()))
    results["async_engine_metrics_ms"] = asyncio.run(
        streamed("metrics", recorder.after_step)) * 1e3
    engine.shutdown()
    return results


def measure_served(model_dir: Path, tokens: int, log_dir: Path, up_args: list[str]) -> dict:
    from tandem.bench.config import BenchmarkConfig
    from tandem.bench.runner import run_benchmark
    from tandem.bench.up_stack import UpStack

    stack = UpStack(["--model", str(model_dir), "--both", "1", "--load-format", "dummy",
                     "--max-model-len", str(CONTEXT + tokens + 64), *up_args], log_dir,
                    omp_num_threads=None)
    try:
        common = dict(router=stack.router.address, input_len=str(CONTEXT),
                      output_len=str(tokens), concurrency=1, timeout_s=600.0)
        run_benchmark(BenchmarkConfig(**common, num_requests=2, seed=1))  # warm-up

        def step_histogram() -> tuple[float, float]:
            name = "tandem:engine_step_seconds"
            return tuple(sum(sample.value for sample in stack.samples(stack.workers[0],
                                                                       name + suffix))
                         for suffix in ("_sum", "_count"))

        before = step_histogram()
        result = run_benchmark(BenchmarkConfig(**common, num_requests=3, seed=2))
        after = step_histogram()
        steps = after[1] - before[1]
        return {"client_tpot_ms": result.stats["tpot_s"]["p50"] * 1e3,
                "worker_step_mean_ms": (after[0] - before[0]) / steps * 1e3 if steps else None,
                "worker_steps": steps}
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.probes.served_gap",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--up-args", default="", help="extra `tandem up` flags for phase 4")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    import shlex

    from tandem.bench.disagg_stack import write_tokenizer
    from tandem.bench.engine import in_child
    from tandem.bench.engine_models import write_model_dir

    with tempfile.TemporaryDirectory() as root:
        model_dir = write_model_dir("llama3-8b", Path(root))
        write_tokenizer(model_dir)
        report = in_child(measure_in_process, model_dir, args.tokens)
        report.update(measure_served(model_dir, args.tokens, Path(root),
                                     shlex.split(args.up_args)))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    for name, value in report.items():
        print(f"{name:<28} {value:.3f}" if isinstance(value, float) else f"{name:<28} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

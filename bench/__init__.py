"""tandem.bench: a load generator for a Tandem router, and `tandem bench`.

    from tandem.bench import BenchmarkConfig, run_benchmark

    result = run_benchmark(BenchmarkConfig(router="127.0.0.1:50051", concurrency=4,
                                           num_requests=40, input_len="uniform:16:64",
                                           output_len="32"))
    print(result.table())             # the fixed-width summary `tandem bench` prints
    result.stats["ttft_s"]["p50"]     # seconds; see tandem.bench.report for every key
    result.to_json()                  # config, model, stats and a summary of each request

Modules: config (BenchmarkConfig), workload (lengths, synthetic and JSONL prompts), loadgen (the
asyncio driver), records (one request's timings), report (statistics and tables), plot (PNG),
runner (run_benchmark, run_sweep), main (the command line); engine (bench/engine.py: the
engine against the GPU's limits) with engine_limits, engine_models and engine_ops.
"""
import importlib

# Imported on first use, so `python -m tandem.bench.engine` (GPU machines) needs no gRPC stack.
_EXPORTS = {"BenchmarkConfig": "config", "BenchmarkError": "runner",
            "BenchmarkResult": "runner", "async_run_benchmark": "runner",
            "run_benchmark": "runner", "run_sweep": "runner"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tandem.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tandem.bench.{_EXPORTS[name]}"), name)

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
runner (run_benchmark, run_sweep), main (the command line).
"""
from tandem.bench.config import BenchmarkConfig
from tandem.bench.main import main
from tandem.bench.runner import (BenchmarkError, BenchmarkResult, async_run_benchmark,
                                 run_benchmark, run_sweep)

__all__ = ["BenchmarkConfig", "BenchmarkError", "BenchmarkResult", "async_run_benchmark", "main",
           "run_benchmark", "run_sweep"]

"""run_benchmark and run_sweep: ask the router for its model, build the workload, drive the load,
compute the statistics.

    from tandem.bench import BenchmarkConfig, run_benchmark

    result = run_benchmark(BenchmarkConfig(router="127.0.0.1:50051", concurrency=8,
                                           num_requests=200, input_len="uniform:16:512",
                                           output_len="128", slo_ttft_s=0.5, slo_tpot_s=0.05))
    print(result.table())
    result.stats["ttft_s"]["p90"], result.stats["output_token_throughput"]
    open("bench.json", "w").write(result.to_json())
"""
from __future__ import annotations

import asyncio
import functools
import json
import resource
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

import grpc

from tandem.bench.config import BenchmarkConfig
from tandem.bench.loadgen import LoadGenerator
from tandem.bench.prefix_workloads import ConversationLoad, shared_prefix_workload
from tandem.bench.records import RequestRecord
from tandem.bench.report import compute_stats, format_table
from tandem.bench.spread import spread_records
from tandem.bench.workload import (FilePrompt, RequestSpec, file_workload, read_prompts_file,
                                   synthetic_workload)
from tandem.client import AsyncTandemClient

__all__ = ["BenchmarkError", "BenchmarkInterrupted", "BenchmarkResult", "async_run_benchmark",
           "run_benchmark", "run_sweep", "sweep_to_json"]
MODEL_INFO_TIMEOUT_S = 30.0


class BenchmarkError(RuntimeError):
    """The benchmark could not start (e.g. the router did not answer GetModelInfo)."""


class BenchmarkInterrupted(Exception):
    """The run was cancelled (Ctrl-C). `results` hold every finished run, then the interrupted
    one with the requests that had finished (those cut off are left out)."""

    def __init__(self, results: list[BenchmarkResult]) -> None:
        super().__init__("interrupted")
        self.results = results


@dataclass(slots=True)
class BenchmarkResult:
    """One run: its config, the served model, every request's record and the statistics.
    `origin_s` is the perf_counter time the load started; record times are relative to it in
    the JSON."""
    config: BenchmarkConfig
    model_info: dict
    records: list[RequestRecord]
    stats: dict
    started_at: str
    origin_s: float

    def to_dict(self) -> dict:
        return {"config": self.config.to_dict(), "model": self.model_info,
                "started_at": self.started_at, "stats": self.stats,
                "requests": [record.summary(self.origin_s) for record in self.records]}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def table(self) -> str:
        return format_table(self.stats, router=self.config.target,
                            load=self.config.load_shape(), model=self.model_info.get("model", ""))


async def async_run_benchmark(config: BenchmarkConfig,
                              client_options: dict | None = None) -> BenchmarkResult:
    """run_benchmark inside a running event loop. Cancelled, it raises BenchmarkInterrupted
    with the requests that had finished."""
    prompts = read_prompts_file(config.prompts_file) if config.prompts_file else None
    async with open_client(config, client_options or {}) as client:
        model_info = await _model_info(client, config.target)
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        origin_s = time.perf_counter()
        cpu_before = _generator_cpu_seconds()
        if config.processes > 1:  # the loop waits: the children do the work
            records, interrupted = spread_records(
                config, client_options or {},
                functools.partial(_workload, config, model_info, prompts))
            result = _result(config, model_info, records, started_at, origin_s, cpu_before)
            if interrupted:
                raise BenchmarkInterrupted([result])
            return result
        generator = (ConversationLoad(client, config, model_info) if config.workload == "chat"
                     else LoadGenerator(client, config, _workload(config, model_info, prompts)))
        try:
            records = await generator.run()
        except asyncio.CancelledError:
            finished = sorted((r for r in generator.records if r.error_code != "CANCELLED"),
                              key=lambda record: record.index)
            raise BenchmarkInterrupted([_result(config, model_info, finished, started_at,
                                                origin_s, cpu_before)]) from None
    return _result(config, model_info, records, started_at, origin_s, cpu_before)


def _generator_cpu_seconds() -> float:
    """CPU seconds of this process and of its load-generator children that have ended."""
    return sum(usage.ru_utime + usage.ru_stime for usage in (
        resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))


def _result(config: BenchmarkConfig, model_info: dict, records: list[RequestRecord],
            started_at: str, origin_s: float, cpu_before: float) -> BenchmarkResult:
    stats = compute_stats(records, slo_ttft_s=config.slo_ttft_s, slo_tpot_s=config.slo_tpot_s)
    cpu_seconds = _generator_cpu_seconds() - cpu_before
    wall_seconds = max(time.perf_counter() - origin_s, 1e-9)
    stats["generator"] = {"processes": config.processes, "cpu_s": cpu_seconds,
                          "cpu_cores": cpu_seconds / wall_seconds}
    return BenchmarkResult(config, model_info, records, stats, started_at, origin_s)


def run_benchmark(config: BenchmarkConfig,
                  client_options: dict | None = None) -> BenchmarkResult:
    """Runs one benchmark to the end (its own event loop). Raises BenchmarkError when the
    router cannot be asked for its model, ValueError for a bad prompts file,
    BenchmarkInterrupted on Ctrl-C. `client_options`: AsyncTandemClient keyword arguments
    (token, TLS files)."""
    return asyncio.run(async_run_benchmark(config, client_options))


def run_sweep(config: BenchmarkConfig, rates: Sequence[float],
              client_options: dict | None = None) -> list[BenchmarkResult]:
    """One open-loop run per Poisson rate, in the order given, each with `config`'s workload."""
    async def sweep() -> list[BenchmarkResult]:
        results = []
        for rate in rates:
            try:
                results.append(await async_run_benchmark(config.with_rate(rate),
                                                         client_options))
            except BenchmarkInterrupted as interrupted:
                raise BenchmarkInterrupted(results + interrupted.results) from None
        return results

    return asyncio.run(sweep())


def sweep_to_json(rates: Sequence[float], results: Sequence[BenchmarkResult]) -> str:
    """A sweep's JSON: {"rates": [...], "runs": [one BenchmarkResult.to_dict() per rate]}."""
    return json.dumps({"rates": list(rates), "runs": [result.to_dict() for result in results]},
                      indent=2)


def open_client(config: BenchmarkConfig, client_options: dict):
    """The gRPC client, or the HTTP one when `config.http` is set (same interface)."""
    if config.http is not None:
        from tandem.bench.http_client import HTTPBenchClient

        return HTTPBenchClient(config.http, **client_options)
    return AsyncTandemClient(config.router, **client_options)


async def _model_info(client, router: str) -> dict:
    try:
        return await client.model_info(timeout=MODEL_INFO_TIMEOUT_S)
    except grpc.RpcError as exc:  # HTTPCallError is one too
        raise BenchmarkError(f"router {router} did not answer GetModelInfo: "
                             f"{exc.code().name}: {exc.details()}") from None


def _workload(config: BenchmarkConfig, model_info: dict,
              prompts: list[FilePrompt] | None) -> Iterator[RequestSpec]:
    if prompts is not None:
        return file_workload(prompts, config.output_dist, seed=config.seed)
    if config.workload == "shared-prefix":
        return shared_prefix_workload(config.groups, config.prefix_len, config.input_dist,
                                      config.output_dist, vocab_size=model_info["vocab_size"],
                                      eos_token_ids=model_info["eos_token_ids"],
                                      max_model_len=model_info["max_model_len"],
                                      seed=config.seed)
    return synthetic_workload(config.input_dist, config.output_dist,
                              vocab_size=model_info["vocab_size"],
                              eos_token_ids=model_info["eos_token_ids"],
                              max_model_len=model_info["max_model_len"], seed=config.seed)

"""Prometheus metrics of every tier, defined in one place.

Names follow vLLM's where the quantity is the same (same bucket boundaries), under a `tandem:`
prefix; every series has `model` and `tier` labels (tier: router, prefill, decode, both).
Dashboards and alert rules in deploy/ may use only names defined here (a test checks it).
prometheus-client appends `_total` to counters and `_bucket/_sum/_count` to histograms.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)

# vLLM's boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Tandem's own: sub-millisecond resolution for the parts of TTFT and for steps and transfers.
FINE_SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                        0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
# A refusal is decided in tens of microseconds; a slow one means a busy event loop.
REFUSAL_SECONDS_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02,
                           0.05, 0.1, 0.25, 1.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BASE_LABELS = ("model", "tier")


class _Metrics:
    """Creates metrics in a registry of its own and binds the model/tier labels once."""

    def __init__(self, model: str, tier: str, registry: CollectorRegistry | None) -> None:
        self.registry = registry or CollectorRegistry()
        self._base = {"model": model, "tier": tier}

    def _histogram(self, name: str, doc: str, buckets, labels: tuple[str, ...] = ()):
        metric = Histogram(name, doc, BASE_LABELS + labels, buckets=buckets,
                           registry=self.registry)
        return metric.labels(**self._base) if not labels else _Partial(metric, self._base)

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()):
        metric = Counter(name, doc, BASE_LABELS + labels, registry=self.registry)
        return metric.labels(**self._base) if not labels else _Partial(metric, self._base)

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()):
        metric = Gauge(name, doc, BASE_LABELS + labels, registry=self.registry)
        return metric.labels(**self._base) if not labels else _Partial(metric, self._base)

    def serve(self, port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
        """Serve /metrics over HTTP on a daemon thread."""
        return serve_metrics(self.registry, port, host)


def serve_metrics(registry: CollectorRegistry, port: int, host: str,
                  pages: Callable[[str], bytes | None] | None = None) -> ThreadingHTTPServer:
    """/metrics in the Prometheus text format, always; `pages(path)` may serve other paths
    (None: 404).

    prometheus-client's own server answers an OpenMetrics Accept header (which Prometheus
    sends) with names whose ':' became '_', so `tandem:x` would be stored as `tandem_x` and
    break every dashboard. The text format keeps the names as written.
    """

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?")[0]
            if path in ("/metrics", "/"):
                body = generate_latest(registry)
            else:
                body = pages(path) if pages is not None else None
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # scrapes every second: keep the log quiet
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


class _Partial:
    """A labelled metric with model/tier already bound: .labels(status="stop")."""

    def __init__(self, metric, base: dict) -> None:
        self._metric, self._base = metric, base

    def labels(self, **labels):
        return self._metric.labels(**self._base, **labels)


class RouterMetrics(_Metrics):
    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        super().__init__(model, "router", registry)
        self.time_to_first_token = self._histogram(
            "tandem:time_to_first_token_seconds",
            "Time from arrival at the router to the first token sent to the client.",
            TTFT_BUCKETS)
        self.ttft_part = self._histogram(
            "tandem:time_to_first_token_part_seconds",
            "TTFT split into parts that add up to it: router_queue (validation, tokenization, "
            "admission), prefill_queue, prefill_compute, first_token_delivery (the rest).",
            FINE_SECONDS_BUCKETS, ("part",))
        self.inter_token_latency = self._histogram(
            "tandem:inter_token_latency_seconds",
            "Time between consecutive tokens sent to the client.", TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = self._histogram(
            "tandem:request_time_per_output_token_seconds",
            "Per request: (last token time - first token time) / (tokens - 1).",
            TOKEN_LATENCY_BUCKETS)
        self.e2e_latency = self._histogram(
            "tandem:e2e_request_latency_seconds", "Arrival to the final message.",
            REQUEST_LATENCY_BUCKETS)
        self.queue_time = self._histogram(
            "tandem:request_queue_time_seconds",
            "Arrival to dispatch to a worker (validation, tokenization, admission queue).",
            REQUEST_LATENCY_BUCKETS)
        self.tokenization_time = self._histogram(
            "tandem:tokenization_time_seconds", "Tokenizing a prompt (or chat template).",
            FINE_SECONDS_BUCKETS)
        self.refusal_time = self._histogram(
            "tandem:refusal_seconds",
            "Requests refused RESOURCE_EXHAUSTED at admission (the router full; HTTP 429): "
            "from the request handler starting to the refusal handed to gRPC or HTTP (the "
            "time a call waited before its handler started is not in it).",
            REFUSAL_SECONDS_BUCKETS)
        self.requests_finished = self._counter(
            "tandem:requests_finished",
            "Requests ended, by status: a finish reason (stop, length) or a gRPC code name.",
            ("status",))
        self.prompt_tokens = self._counter("tandem:prompt_tokens",
                                           "Prompt tokens of requests sent to workers.")
        self.generation_tokens = self._counter("tandem:generation_tokens",
                                               "Tokens streamed to clients.")
        self.num_requests_running = self._gauge(
            "tandem:num_requests_running", "Requests dispatched to workers, not finished.")
        self.num_requests_waiting = self._gauge(
            "tandem:num_requests_waiting", "Requests waiting for admission.")
        self.worker_healthy = self._gauge(
            "tandem:worker_healthy", "1 if the worker is in the routing pool.",
            ("worker", "role"))
        self.routing_decisions = self._counter(
            "tandem:routing_decisions", "Requests sent to each worker.", ("worker", "role"))
        self.worker_ejections = self._counter(
            "tandem:worker_ejections",
            "Workers taken out of the routing pool, by cause: unreachable, not_serving, "
            "failed_checks (too many in a row), request (a request failed), stall.",
            ("worker", "role", "cause"))
        self.request_migrations = self._counter(
            "tandem:request_migrations",
            "Requests moved to another worker after theirs failed, by cause: stall, "
            "unavailable (connection lost, worker gone), stream_ended, error.", ("cause",))
        self.worker_rejoins = self._counter(
            "tandem:worker_rejoins", "Ejected workers back in the routing pool after a good "
            "check.", ("worker", "role"))
        self.routing_reasons = self._counter(
            "tandem:routing_reasons",
            "Routing decisions by reason: cache_hit (the worker holding most of the prompt), "
            "load_override (a worker holding more was too busy), least_loaded (nobody holds "
            "it, or --routing least-loaded), round_robin, local_prefill (a decode worker "
            "holding nearly all of the prompt prefills it itself).", ("reason", "role"))
        self.decode_refusals = self._counter(
            "tandem:decode_refusals",
            "Prefilled requests a decode worker refused (RESOURCE_EXHAUSTED: no free KV "
            "blocks in time) and the router offered another decode worker.", ("worker",))
        self.routing_predicted_cached_tokens = self._counter(
            "tandem:routing_predicted_cached_tokens",
            "Prompt tokens the router expected the chosen prefill (or both, or locally "
            "prefilling decode) worker to serve from its prefix cache.")
        self.routing_actual_cached_tokens = self._counter(
            "tandem:routing_actual_cached_tokens",
            "Prompt tokens the prefill (or both, or locally prefilling decode) worker served "
            "from its prefix cache "
            "(Complete.usage.cached_prompt_tokens), for requests the policy predicted.")
        self.kv_index_blocks = self._gauge(
            "tandem:kv_index_blocks", "Prefix-cache blocks the router's index holds for a "
            "worker (from its KV event stream).", ("worker", "role"))
        self.kv_event_reconnects = self._counter(
            "tandem:kv_event_reconnects", "KV event streams that broke or ended and were "
            "subscribed again (from a fresh snapshot).", ("worker", "role"))


class RouterSupervisorMetrics(_Metrics):
    """The parent of `tandem router --processes N` (router/supervisor.py)."""

    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        super().__init__(model, "router", registry)
        self.process_restarts = self._counter(
            "tandem:router_process_restarts",
            "Router processes started again after one exited unexpectedly.")
        self.num_processes = self._gauge("tandem:router_processes",
                                         "Router processes running.")


class WorkerMetrics(_Metrics):
    def __init__(self, model: str, tier: str, registry: CollectorRegistry | None = None) -> None:
        super().__init__(model, tier, registry)
        self.num_requests_running = self._gauge("tandem:num_requests_running",
                                                "Sequences in the running batch.")
        self.num_requests_waiting = self._gauge("tandem:num_requests_waiting",
                                                "Sequences waiting for admission.")
        self.kv_cache_usage = self._gauge("tandem:kv_cache_usage_perc",
                                          "KV-cache usage; 1 means 100 percent.")
        self.num_kv_blocks = self._gauge("tandem:num_kv_blocks", "KV blocks in the cache.")
        self.num_kv_blocks_used = self._gauge("tandem:num_kv_blocks_used",
                                              "KV blocks held by sequences or pinned prompts.")
        self.prefix_cache_queries = self._counter(
            "tandem:prefix_cache_queries", "Prefix cache queries, in tokens looked up.")
        self.prefix_cache_hits = self._counter(
            "tandem:prefix_cache_hits", "Prefix cache hits, in tokens found.")
        self.num_preemptions = self._counter("tandem:num_preemptions",
                                             "Sequences preempted (recomputed later).")
        self.prompt_tokens = self._counter(
            "tandem:prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).")
        self.generation_tokens = self._counter("tandem:generation_tokens",
                                               "Tokens sampled.")
        self.iteration_tokens = self._histogram(
            "tandem:iteration_tokens_total", "Tokens per engine step.",
            ITERATION_TOKENS_BUCKETS)
        self.batch_size = self._histogram("tandem:batch_size",
                                          "Sequences per engine step.", BATCH_SIZE_BUCKETS)
        self.step_time = self._histogram("tandem:engine_step_seconds",
                                         "Wall time of one engine step.", FINE_SECONDS_BUCKETS)
        self.queue_time = self._histogram(
            "tandem:request_queue_time_seconds",
            "Arrival at this worker to first scheduled.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = self._histogram(
            "tandem:request_prefill_time_seconds",
            "First scheduled to first token (prompt compute).", FINE_SECONDS_BUCKETS)
        self.requests_finished = self._counter(
            "tandem:requests_finished", "Sequences ended here, by finish reason or pinned.",
            ("status",))
        self.kv_handles_pinned = self._gauge("tandem:kv_handles_pinned",
                                             "Prefilled prompts whose KV waits to be pulled.")
        self.kv_lease_expiries = self._counter(
            "tandem:kv_lease_expiries", "Pinned prompts freed because nobody pulled them.")
        self.kv_transfer_time = self._histogram(
            "tandem:kv_transfer_seconds", "Time to pull one prompt's KV.",
            FINE_SECONDS_BUCKETS)
        self.kv_transfer_bytes = self._counter("tandem:kv_transfer_bytes",
                                               "KV bytes pulled from prefill workers.")
        self.kv_transfer_failures = self._counter("tandem:kv_transfer_failures",
                                                  "KV pulls that failed.")
        self.kv_pull_recomputes = self._counter(
            "tandem:kv_pull_recomputes", "Prompts computed here after their KV pull failed.")
        self.grammar_compile_time = self._histogram(
            "tandem:grammar_compile_seconds",
            "Time to compile one structured-output grammar (cache misses).",
            FINE_SECONDS_BUCKETS)
        self.grammar_cache_hits = self._counter(
            "tandem:grammar_cache_hits",
            "Structured-output requests whose grammar was already compiled (or compiling).")
        self.constrained_requests = self._counter(
            "tandem:constrained_requests", "Requests with a structured-output grammar.")
        self.jit_compiles = self._counter(
            "tandem:jit_compiles", "Triton kernel variants compiled, at startup or while "
            "serving (a serving compile stalls the engine step).", ("phase",))
        self.jit_compile_seconds = self._counter(
            "tandem:jit_compile_seconds", "Seconds spent compiling Triton kernel variants.",
            ("phase",))

    def record_jit_compile(self, kernel: str, seconds: float, serving: bool) -> None:
        phase = "serving" if serving else "startup"
        self.jit_compiles.labels(phase=phase).inc()
        self.jit_compile_seconds.labels(phase=phase).inc(seconds)

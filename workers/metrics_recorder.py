"""Feeds a worker's Prometheus metrics from its engine, on the engine thread after each step.

Counters kept by the engine (prefix cache, preemptions, finished requests, lease expiries) are
cumulative there; this turns them into Prometheus counter increments by difference, from
their values when the recorder is made (so a startup warm-up is not counted).
"""
from __future__ import annotations

from collections import Counter

from tandem.common.metrics import WorkerMetrics
from tandem.workers.engine.engine import LLMEngine
from tandem.workers.engine.sequence import Sequence


class WorkerMetricsRecorder:
    def __init__(self, engine: LLMEngine, metrics: WorkerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        manager = engine.block_manager
        self._seen: dict[str, float] = {
            "queries": manager.prefix_cache_queries, "hits": manager.prefix_cache_hits,
            "preemptions": engine.scheduler.num_preemptions,
            "expiries": engine.num_expired_leases,
            "grammar_hits": engine.grammars.num_cache_hits,
            "constrained": engine.num_constrained_requests}
        self._finished: Counter[str] = Counter(engine.num_finished)
        metrics.num_kv_blocks.set(manager.num_blocks)
        engine.grammars.on_compiled.append(metrics.grammar_compile_time.observe)
        self.update_gauges()

    def after_step(self, updated: list[Sequence] | None) -> None:
        """updated: the sequences that got a token in the step just run; None if idle."""
        if updated is None:
            self.update_gauges()
            return
        engine, m = self.engine, self.metrics
        step = engine.last_step
        if step is not None:
            m.step_time.observe(step.seconds)
            m.batch_size.observe(step.num_seqs)
            m.iteration_tokens.observe(step.num_tokens)
            m.prompt_tokens.inc(step.num_prefill_tokens)
            m.generation_tokens.inc(step.num_sampled)
        for seq in updated:  # the first token produced here: queue and prefill times
            if seq.num_completion_tokens == 1 and seq.first_scheduled_time is not None:
                m.queue_time.observe(seq.first_scheduled_time - seq.arrival_time)
                m.prefill_time.observe(seq.first_token_time - seq.first_scheduled_time)
        self.update_gauges()

    def update_gauges(self) -> None:
        engine, m = self.engine, self.metrics
        manager = engine.block_manager
        m.num_requests_running.set(len(engine.scheduler.running))
        m.num_requests_waiting.set(len(engine.scheduler.waiting))
        m.kv_cache_usage.set(manager.usage)
        m.num_kv_blocks_used.set(manager.num_blocks - manager.num_free_blocks)
        m.kv_handles_pinned.set(len(engine.pinned))
        self._count(m.prefix_cache_queries, "queries", manager.prefix_cache_queries)
        self._count(m.prefix_cache_hits, "hits", manager.prefix_cache_hits)
        self._count(m.num_preemptions, "preemptions", engine.scheduler.num_preemptions)
        self._count(m.kv_lease_expiries, "expiries", engine.num_expired_leases)
        self._count(m.grammar_cache_hits, "grammar_hits", engine.grammars.num_cache_hits)
        self._count(m.constrained_requests, "constrained", engine.num_constrained_requests)
        for status, total in engine.num_finished.items():
            if total > self._finished[status]:
                m.requests_finished.labels(status=status).inc(total - self._finished[status])
                self._finished[status] = total

    def _count(self, counter, key: str, total: float) -> None:
        delta = total - self._seen.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._seen[key] = total

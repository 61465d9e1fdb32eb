"""Builds Tandem's Grafana dashboards; run it after an edit and commit the JSON it writes.

    python deploy/grafana/build_dashboards.py   # writes tandem-overview.json, tandem-tier.json

The JSON imports as-is (no __inputs): a `datasource` variable picks the Prometheus, and `job`,
`namespace`, `model`, `tier` filter every query. `namespace` and `job` default to `.*`, which
also matches series without the label (a local run has no `namespace`). Percentiles are computed
inline with histogram_quantile, so the dashboards work without deploy/prometheus's recording
rules and follow the variables. Metric names are those of tandem/common/metrics.py; a unit test
(tests/unit/deploy) checks every name in every expression against what Tandem exports.
"""
from __future__ import annotations

import json
from pathlib import Path

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
QUANTILES = (0.5, 0.9, 0.99)
# Filters every query of both dashboards starts from.
BASE_FILTER = ('job=~"$job"', 'namespace=~"$namespace"', 'model=~"$model"')
TIER_FILTER = BASE_FILTER + ('tier=~"$tier"', 'instance=~"$instance"')


def selector(*matchers: str, base: tuple[str, ...] = BASE_FILTER) -> str:
    return "{" + ", ".join(base + matchers) + "}"


def quantile_targets(histogram: str, sel: str, by: str = "", quantiles=QUANTILES) -> list:
    """(expr, legend) for each quantile of `histogram` (base name, without _bucket)."""
    group = f"le, {by}" if by else "le"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [(f"histogram_quantile({q}, sum by ({group}) "
             f"(rate({histogram}_bucket{sel}[{RATE}])))", f"p{round(q * 100)}{suffix}")
            for q in quantiles]


def mean_target(histogram: str, sel: str, legend: str = "mean") -> tuple[str, str]:
    return (f"sum(rate({histogram}_sum{sel}[{RATE}])) / sum(rate({histogram}_count{sel}[{RATE}]))",
            legend)


def _targets(queries) -> list[dict]:
    return [{"datasource": DATASOURCE, "expr": expr, "legendFormat": legend,
             "refId": chr(ord("A") + i), "range": True}
            for i, (expr, legend) in enumerate(queries)]


def timeseries(title: str, description: str, queries, unit: str = "short", *,
               stack: bool = False, max_value: float | None = None,
               threshold: float | None = None, overrides: list | None = None) -> dict:
    defaults = {
        "unit": unit, "min": 0,
        "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 30 if stack else 10,
                   "showPoints": "never", "spanNulls": False,
                   "stacking": {"mode": "normal" if stack else "none", "group": "A"},
                   "thresholdsStyle": {"mode": "off" if threshold is None else "dashed"}},
        "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}] + (
            [] if threshold is None else [{"color": "red", "value": threshold}])},
    }
    if max_value is not None:
        defaults["max"] = max_value
    return {"type": "timeseries", "title": title, "description": description,
            "datasource": DATASOURCE, "targets": _targets(queries),
            "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom",
                                   "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}}}


def stat(title: str, description: str, queries) -> dict:
    return {"type": "stat", "title": title, "description": description,
            "datasource": DATASOURCE, "targets": _targets(queries),
            "fieldConfig": {"defaults": {"unit": "short", "thresholds": {
                "mode": "absolute",
                "steps": [{"color": "red", "value": None}, {"color": "green", "value": 1}]}},
                "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "background", "graphMode": "none", "textMode": "auto",
                        "orientation": "auto", "justifyMode": "auto"}}


def state_timeline(title: str, description: str, queries) -> dict:
    mappings = [{"type": "value", "options": {
        "0": {"text": "out of pool", "color": "red", "index": 0},
        "1": {"text": "healthy", "color": "green", "index": 1}}}]
    return {"type": "state-timeline", "title": title, "description": description,
            "datasource": DATASOURCE, "targets": _targets(queries),
            "fieldConfig": {"defaults": {"mappings": mappings, "custom": {"fillOpacity": 80}},
                            "overrides": []},
            "options": {"mergeValues": True, "showValue": "never", "rowHeight": 0.9,
                        "legend": {"displayMode": "list", "placement": "bottom",
                                   "showLegend": False}}}


def unstacked_dashed_line(series_name: str) -> dict:
    """An override drawing one series of a stacked panel as a dashed reference line."""
    return {"matcher": {"id": "byName", "options": series_name}, "properties": [
        {"id": "custom.stacking", "value": {"mode": "none", "group": "A"}},
        {"id": "custom.fillOpacity", "value": 0},
        {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}]}


class Grid:
    """Lays panels out left to right in Grafana's 24-column grid and numbers them."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self._x = self._y = self._row_height = 0

    def row(self, title: str) -> None:
        self._newline()
        self._append({"type": "row", "title": title, "collapsed": False, "panels": [],
                      "datasource": DATASOURCE}, w=24, h=1)
        self._newline()

    def add(self, panel: dict, w: int = 8, h: int = 8) -> None:
        if self._x + w > 24:
            self._newline()
        self._append(panel, w, h)

    def _append(self, panel: dict, w: int, h: int) -> None:
        panel["id"] = len(self.panels) + 1
        panel["gridPos"] = {"h": h, "w": w, "x": self._x, "y": self._y}
        self.panels.append(panel)
        self._x += w
        self._row_height = max(self._row_height, h)

    def _newline(self) -> None:
        if self._x:
            self._y += self._row_height
        self._x = self._row_height = 0


def query_variable(name: str, label: str, query: str, *, include_all: bool = True) -> dict:
    """A variable filled by `label_values(...)`; with All (`.*`) unless include_all is False."""
    variable = {"type": "query", "name": name, "label": label, "datasource": DATASOURCE,
                "query": query, "definition": query, "refresh": 2, "regex": "", "sort": 1,
                "hide": 0, "includeAll": include_all, "multi": include_all, "options": [],
                "current": {}}
    if include_all:
        variable["allValue"] = ".*"
        variable["current"] = {"selected": True, "text": ["All"], "value": ["$__all"]}
    return variable


def common_variables() -> list[dict]:
    return [
        {"type": "datasource", "name": "datasource", "label": "Data source",
         "query": "prometheus", "refresh": 1, "regex": "", "hide": 0, "includeAll": False,
         "multi": False, "options": [], "current": {}},
        query_variable("job", "Job", "label_values(tandem:num_requests_running, job)"),
        query_variable("namespace", "Namespace",
                       'label_values(tandem:num_requests_running{job=~"$job"}, namespace)'),
        query_variable("model", "Model", 'label_values(tandem:num_requests_running'
                       '{job=~"$job", namespace=~"$namespace"}, model)'),
    ]


def dashboard(title: str, uid: str, description: str, grid: Grid, variables: list) -> dict:
    return {
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard"}]},
        "description": description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [{"title": "Tandem dashboards", "type": "dashboards", "tags": ["tandem"],
                   "asDropdown": False, "includeVars": True, "keepTime": True}],
        "panels": grid.panels,
        "refresh": "30s",
        "schemaVersion": 39,
        "tags": ["tandem"],
        "templating": {"list": variables},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": title,
        "uid": uid,
        "version": 1,
    }


def overview_grid() -> Grid:
    router = selector('tier="router"')
    tiers = selector('tier=~"$tier"')
    workers = selector('tier=~"$tier"', 'tier!="router"')
    errors = selector('tier="router"', 'status!~"stop|length"')
    g = Grid()
    g.row("Latency seen by clients (router)")
    g.add(timeseries("Time to first token", "Arrival at the router to the first token sent.",
                     quantile_targets("tandem:time_to_first_token_seconds", router, "model"),
                     "s", threshold=2.0), w=12)
    g.add(timeseries(
        "TTFT parts (mean)", "Mean of each part of TTFT, stacked; the parts add up to TTFT "
        "(dashed: mean TTFT). router_queue: validation, tokenization, admission; "
        "prefill_queue and prefill_compute: on the prefill worker; first_token_delivery: "
        "the rest.",
        [(f"sum by (part) (rate(tandem:time_to_first_token_part_seconds_sum{router}[{RATE}]))"
          f" / sum by (part) (rate(tandem:time_to_first_token_part_seconds_count{router}"
          f"[{RATE}]))", "{{part}}"),
         mean_target("tandem:time_to_first_token_seconds", router, "mean TTFT")],
        "s", stack=True, overrides=[unstacked_dashed_line("mean TTFT")]), w=12)
    g.add(timeseries("Time per output token (per request)",
                     "(last token time - first token time) / (tokens - 1), per request.",
                     quantile_targets("tandem:request_time_per_output_token_seconds", router,
                                      "model"), "s", threshold=0.1))
    g.add(timeseries("Inter-token latency", "Time between consecutive tokens sent.",
                     quantile_targets("tandem:inter_token_latency_seconds", router, "model"),
                     "s"))
    g.add(timeseries("End-to-end latency", "Arrival to the final message.",
                     quantile_targets("tandem:e2e_request_latency_seconds", router, "model"),
                     "s"))

    g.row("Traffic")
    g.add(timeseries("Requests by status", "Requests ended per second at the router: stop, "
                     "length, or the gRPC status code of an error.",
                     [(f"sum by (status) (rate(tandem:requests_finished_total{router}[{RATE}]))",
                       "{{status}}")], "reqps", stack=True))
    g.add(timeseries(
        "Error ratio", "Requests ending with a status other than stop or length, over all "
        "(alert over 5%).",
        [(f"sum by (model) (rate(tandem:requests_finished_total{errors}[{RATE}]))"
          f" / sum by (model) (rate(tandem:requests_finished_total{router}[{RATE}]))",
          "{{model}}")], "percentunit", threshold=0.05))
    g.add(timeseries(
        "Tokens per second", "Router: prompt tokens sent to workers, tokens streamed to "
        "clients. Workers: prompt tokens computed (prefix-cache hits excluded), tokens sampled.",
        [(f"sum(rate(tandem:prompt_tokens_total{router}[{RATE}]))", "prompt (router)"),
         (f"sum(rate(tandem:generation_tokens_total{router}[{RATE}]))", "generation (router)"),
         (f"sum by (tier) (rate(tandem:prompt_tokens_total{workers}[{RATE}]))",
          "prompt computed ({{tier}})"),
         (f"sum by (tier) (rate(tandem:generation_tokens_total{workers}[{RATE}]))",
          "sampled ({{tier}})")]))

    g.row("Queues and load")
    g.add(timeseries("Queue time", "Router: arrival to dispatch. Workers: arrival at the "
                     "worker to first scheduled.",
                     quantile_targets("tandem:request_queue_time_seconds", tiers, "tier",
                                      (0.5, 0.9)), "s"), w=6)
    g.add(timeseries("Running and waiting", "Router: dispatched / waiting for admission. "
                     "Workers: sequences in the batch / waiting.",
                     [(f"sum by (tier) (tandem:num_requests_running{tiers})", "running {{tier}}"),
                      (f"sum by (tier) (tandem:num_requests_waiting{tiers})",
                       "waiting {{tier}}")]), w=6)
    g.add(timeseries("KV-cache usage per worker", "1 = full (alert over 95% for 5m).",
                     [(f"max by (tier, instance) (tandem:kv_cache_usage_perc{workers})",
                       "{{tier}} {{instance}}")], "percentunit", max_value=1, threshold=0.95), w=6)
    g.add(timeseries("Prefix-cache hit ratio", "Prompt tokens found in the prefix cache over "
                     "tokens looked up.",
                     [(f"sum by (tier) (rate(tandem:prefix_cache_hits_total{workers}[{RATE}]))"
                       f" / sum by (tier) (rate(tandem:prefix_cache_queries_total{workers}"
                       f"[{RATE}]))", "{{tier}}")], "percentunit", max_value=1), w=6)

    g.row("KV transfer (prefill to decode)")
    g.add(timeseries("KV transfer time", "Time for a decode worker to pull one prompt's KV.",
                     quantile_targets("tandem:kv_transfer_seconds", workers, "",
                                      (0.5, 0.9)), "s"))
    g.add(timeseries("KV transfer throughput", "KV bytes pulled per second, in GB/s.",
                     [(f"sum by (instance) (rate(tandem:kv_transfer_bytes_total{workers}"
                       f"[{RATE}])) / 1e9", "{{instance}}")], "GBs"))
    g.add(timeseries(
        "KV lease expiries and transfer failures", "Expiries: prompts prefilled and pinned, "
        "then freed because no decode worker pulled them (wasted prefill; alert on any). "
        "Failures: pulls that failed.",
        [(f"sum by (instance) (increase(tandem:kv_lease_expiries_total{workers}[{RATE}]))",
          "expired {{instance}}"),
         (f"sum by (instance) (increase(tandem:kv_transfer_failures_total{workers}[{RATE}]))",
          "failed {{instance}}")]))

    g.row("Workers (router's view)")
    health = selector('tier="router"')
    g.add(stat("Healthy workers by role", "Workers in the routing pool (alert at 0).",
               [(f"sum by (role) (max by (role, worker) (tandem:worker_healthy{health}))",
                 "{{role}}")]), w=6)
    g.add(state_timeline("Worker health", "Per worker: in the routing pool or not.",
                         [(f"max by (role, worker) (tandem:worker_healthy{health})",
                           "{{role}} {{worker}}")]), w=9)
    g.add(timeseries("Routing decisions", "Requests sent to each worker per second.",
                     [(f"sum by (role, worker) (rate(tandem:routing_decisions_total{health}"
                       f"[{RATE}]))", "{{role}} {{worker}}")], "reqps"), w=9)

    g.row("Cache-aware routing (router's view)")
    g.add(timeseries(
        "Routing decisions by reason", "cache_hit: the worker holding most of the prompt; "
        "load_override: a worker holding more was too busy; least_loaded: nobody held it (or "
        "--routing least-loaded); round_robin; local_prefill: a decode worker holding nearly "
        "all of the prompt prefilled it itself (it is then the request's prompt tier).",
        [(f"sum by (role, reason) (rate(tandem:routing_reasons_total{health}[{RATE}]))",
          "{{role}} {{reason}}")], "reqps", stack=True), w=6)
    g.add(timeseries(
        "Cached prompt tokens: predicted vs actual", "Per second, for the prompt tier "
        "(prefill or both, or a decode worker prefilling locally): what the router's index "
        "predicted, and what the workers served from cache.",
        [(f"sum(rate(tandem:routing_predicted_cached_tokens_total{health}[{RATE}]))",
          "predicted"),
         (f"sum(rate(tandem:routing_actual_cached_tokens_total{health}[{RATE}]))",
          "actual")]), w=6)
    g.add(timeseries(
        "Routed prefix-cache hit rate", "Prompt tokens the prompt tier served from cache "
        "over prompt tokens the router sent.",
        [(f"sum(rate(tandem:routing_actual_cached_tokens_total{health}[{RATE}])) / "
          f"sum(rate(tandem:prompt_tokens_total{health}[{RATE}]))", "hit rate")],
        "percentunit", max_value=1), w=6)
    g.add(timeseries(
        "KV index", "Blocks the router's index holds per worker (from its KV event stream), "
        "and event streams resubscribed per second (a fresh snapshot each).",
        [(f"max by (role, worker) (tandem:kv_index_blocks{health})", "{{role}} {{worker}}"),
         (f"sum by (worker) (rate(tandem:kv_event_reconnects_total{health}[{RATE}]))",
          "resubscribed {{worker}}")]), w=6)
    return g


def tier_grid() -> Grid:
    w = selector(base=TIER_FILTER)
    by_instance = "{{instance}}"
    g = Grid()
    g.row("Engine steps")
    g.add(timeseries("Step time", "Wall time of one engine step.",
                     quantile_targets("tandem:engine_step_seconds", w), "s"))
    g.add(timeseries("Steps per second", "Engine steps run per second.",
                     [(f"sum by (instance) (rate(tandem:engine_step_seconds_count{w}[{RATE}]))",
                       by_instance)], "ops"))
    g.add(timeseries("Busy fraction", "Fraction of wall time spent in engine steps.",
                     [(f"sum by (instance) (rate(tandem:engine_step_seconds_sum{w}[{RATE}]))",
                       by_instance)], "percentunit", max_value=1))
    g.add(timeseries("Batch size", "Sequences per engine step.",
                     quantile_targets("tandem:batch_size", w, "", (0.5, 0.9))
                     + [mean_target("tandem:batch_size", w)]), w=12)
    g.add(timeseries("Iteration tokens", "Tokens per engine step.",
                     quantile_targets("tandem:iteration_tokens_total", w, "", (0.5, 0.9))
                     + [mean_target("tandem:iteration_tokens_total", w)]), w=12)

    g.row("Requests")
    g.add(timeseries("Queue time", "Arrival at the worker to first scheduled.",
                     quantile_targets("tandem:request_queue_time_seconds", w), "s"))
    g.add(timeseries("Prefill time", "First scheduled to first token (prompt compute).",
                     quantile_targets("tandem:request_prefill_time_seconds", w), "s"))
    g.add(timeseries("Running and waiting", "Sequences in the running batch / waiting.",
                     [(f"sum by (instance) (tandem:num_requests_running{w})",
                       "running {{instance}}"),
                      (f"sum by (instance) (tandem:num_requests_waiting{w})",
                       "waiting {{instance}}")]))
    g.add(timeseries("Preemptions", "Sequences preempted per second (recomputed later).",
                     [(f"sum by (instance) (rate(tandem:num_preemptions_total{w}[{RATE}]))",
                       by_instance)]))
    g.add(timeseries("Finished by status", "Sequences ended here per second: finish reason, "
                     "or pinned (prefill workers, KV waiting to be pulled).",
                     [(f"sum by (status) (rate(tandem:requests_finished_total{w}[{RATE}]))",
                       "{{status}}")], stack=True))
    g.add(timeseries("Tokens per second", "Prompt tokens computed (prefix-cache hits "
                     "excluded) and tokens sampled.",
                     [(f"sum by (instance) (rate(tandem:prompt_tokens_total{w}[{RATE}]))",
                       "prompt {{instance}}"),
                      (f"sum by (instance) (rate(tandem:generation_tokens_total{w}[{RATE}]))",
                       "sampled {{instance}}")]))

    g.row("KV cache")
    g.add(timeseries("KV blocks used / total", "Blocks held by sequences or pinned prompts, "
                     "and blocks in the cache.",
                     [(f"sum by (instance) (tandem:num_kv_blocks_used{w})", "used {{instance}}"),
                      (f"sum by (instance) (tandem:num_kv_blocks{w})", "total {{instance}}")]),
          w=6)
    g.add(timeseries("KV-cache usage", "1 = full (alert over 95% for 5m).",
                     [(f"max by (instance) (tandem:kv_cache_usage_perc{w})", by_instance)],
                     "percentunit", max_value=1, threshold=0.95), w=6)
    g.add(timeseries("Prefix-cache hit ratio", "Prompt tokens found over tokens looked up.",
                     [(f"sum by (instance) (rate(tandem:prefix_cache_hits_total{w}[{RATE}]))"
                       f" / sum by (instance) (rate(tandem:prefix_cache_queries_total{w}"
                       f"[{RATE}]))", by_instance)], "percentunit", max_value=1), w=6)
    g.add(timeseries("Pinned KV handles", "Prefilled prompts whose KV waits to be pulled "
                     "(prefill workers).",
                     [(f"sum by (instance) (tandem:kv_handles_pinned{w})", by_instance)]), w=6)

    g.row("KV transfer")
    g.add(timeseries("KV transfer time", "Time to pull one prompt's KV (decode workers).",
                     quantile_targets("tandem:kv_transfer_seconds", w), "s"), w=6)
    g.add(timeseries("KV transfer throughput", "KV bytes pulled per second, in GB/s.",
                     [(f"sum by (instance) (rate(tandem:kv_transfer_bytes_total{w}[{RATE}]))"
                       f" / 1e9", by_instance)], "GBs"), w=6)
    g.add(timeseries("KV pulls and failures", "Pulls completed and pulls failed per second.",
                     [(f"sum by (instance) (rate(tandem:kv_transfer_seconds_count{w}[{RATE}]))",
                       "pulled {{instance}}"),
                      (f"sum by (instance) (rate(tandem:kv_transfer_failures_total{w}[{RATE}]))",
                       "failed {{instance}}")], "ops"), w=6)
    g.add(timeseries("KV lease expiries", "Pinned prompts freed because nobody pulled them "
                     "(prefill workers).",
                     [(f"sum by (instance) (increase(tandem:kv_lease_expiries_total{w}"
                       f"[{RATE}]))", by_instance)]), w=6)
    return g


def build() -> dict[str, dict]:
    """File name -> dashboard."""
    overview_vars = common_variables() + [query_variable(
        "tier", "Tier", 'label_values(tandem:num_requests_running{job=~"$job", '
        'namespace=~"$namespace", model=~"$model"}, tier)')]
    tier_vars = common_variables() + [
        query_variable("tier", "Tier", 'label_values(tandem:num_kv_blocks{job=~"$job", '
                       'namespace=~"$namespace", model=~"$model"}, tier)', include_all=False),
        query_variable("instance", "Worker", 'label_values(tandem:num_kv_blocks{job=~"$job", '
                       'namespace=~"$namespace", model=~"$model", tier=~"$tier"}, instance)')]
    return {
        "tandem-overview.json": dashboard(
            "Tandem / Overview", "tandem-overview",
            "Client-facing latency, traffic, load, KV transfer and worker health of a Tandem "
            "deployment (router, prefill, decode).", overview_grid(), overview_vars),
        "tandem-tier.json": dashboard(
            "Tandem / Tier", "tandem-tier",
            "One worker tier (prefill, decode or both): engine steps, queues, KV cache and KV "
            "transfer, per worker.", tier_grid(), tier_vars),
    }


def main() -> None:
    here = Path(__file__).resolve().parent
    for name, board in build().items():
        (here / name).write_text(json.dumps(board, indent=2) + "\n")
        print(f"wrote {here / name}")


if __name__ == "__main__":
    main()

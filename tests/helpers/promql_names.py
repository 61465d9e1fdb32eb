"""Metric names used by the PromQL in deploy/: the dashboards' queries and the alert rules.

A test checks each name against the samples Tandem exports (tests/unit/deploy); an end-to-end
test can check them against a live /metrics page with `sample_names` and `undefined_names`.

What counts as a metric name: the name of every vector selector (`foo{...}`, `foo[5m]`) and the
value of an equality `__name__="foo"` matcher, wherever it sits in the expression tree. Label
names and values, function and aggregation names, string arguments (label_replace's), numbers,
and Grafana variables inside label values are not names. A regex on `__name__` cannot be
checked and raises ValueError. Grafana's interval variables (`$__rate_interval`, ...) are
replaced by a duration before parsing; any other `$variable` outside a quoted string makes the
expression fail to parse, as it would in Prometheus.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import promql_parser
import yaml

GRAFANA_DIR = Path("deploy/grafana")
RULES_DIR = Path("deploy/prometheus")
# Grafana's built-in range variables, written `$__x` or `${__x}`; any valid duration will do.
_GRAFANA_INTERVAL = re.compile(r"\$\{?__(?:rate_interval|interval|range)(?:_ms|_s)?\}?")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<args>.*)\)\s*$", re.DOTALL)
_QUERY_RESULT = re.compile(r"^\s*query_result\((?P<expr>.*)\)\s*$", re.DOTALL)


def expressions_in_deploy(repo_root: Path | str) -> list[tuple[str, str]]:
    """(source, expr) for every PromQL expression of deploy/grafana/*.json and the rule files
    in deploy/prometheus; source names the file and the panel, variable or rule."""
    root = Path(repo_root)
    found = []
    for path in sorted((root / GRAFANA_DIR).glob("*.json")):
        found += _dashboard_expressions(path.name, json.loads(path.read_text()))
    for path in _rule_files(root):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                rule_name = rule.get("record") or rule.get("alert")
                found.append((f"{path.name}: {group['name']}/{rule_name}", str(rule["expr"])))
    return found


def recording_rule_names(repo_root: Path | str) -> set[str]:
    """Series names the rule files record (`record:`)."""
    return {rule["record"]
            for path in _rule_files(Path(repo_root))
            for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"] if "record" in rule}


def metric_names(expr: str) -> set[str]:
    """Every metric name `expr` selects; raises ValueError if it does not parse."""
    names: set[str] = set()
    _collect(promql_parser.parse(_GRAFANA_INTERVAL.sub("5m", expr)), names)
    return names


def sample_names(exposition: str) -> set[str]:
    """Sample names of a /metrics page, text or OpenMetrics format, as Prometheus stores them:
    with the `_total`, `_bucket`, `_sum`, `_count`, `_created` suffixes prometheus-client adds
    (HELP/TYPE lines are ignored; quoted UTF-8 names are not supported)."""
    return {line.split("{", 1)[0].split(" ", 1)[0]
            for line in exposition.splitlines() if line and not line.startswith("#")}


def undefined_names(repo_root: Path | str, exported: set[str]) -> list[tuple[str, str]]:
    """(source, name) for each name in deploy/ that is neither exported nor recorded."""
    known = exported | recording_rule_names(repo_root)
    return [(source, name) for source, expr in expressions_in_deploy(repo_root)
            for name in sorted(metric_names(expr)) if name not in known]


def _rule_files(root: Path) -> list[Path]:
    return sorted((root / RULES_DIR).glob("*.yaml")) + sorted((root / RULES_DIR).glob("*.yml"))


def _dashboard_expressions(file_name: str, dashboard: dict) -> list[tuple[str, str]]:
    found = []
    for panel in _panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                found.append((f"{file_name}: panel {panel.get('id')} {panel.get('title')!r} "
                              f"target {target.get('refId')}", target["expr"]))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        query = query.get("query", "") if isinstance(query, dict) else query
        expr = variable_expression(query or "")
        if expr:
            found.append((f"{file_name}: variable {variable['name']}", expr))
    return found


def variable_expression(query: str) -> str | None:
    """The PromQL in a Grafana Prometheus variable query: the metric (selector) of
    `label_values(metric, label)`, the expression of `query_result(expr)`; None for
    `label_values(label)`, `label_names()` and `metrics(regex)`, which name no metric."""
    if match := _QUERY_RESULT.match(query):
        return match["expr"]
    if match := _LABEL_VALUES.match(query):
        args = match["args"]
        if "," in args:  # label_values(selector, label): the label is after the last comma
            return args[: args.rindex(",")].strip()
    return None


def _panels(panels: list[dict]):
    """Panels, including those inside collapsed rows."""
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _collect(node, names: set[str]) -> None:
    if isinstance(node, promql_parser.VectorSelector):
        if node.name:
            names.add(node.name)
        matchers = node.matchers
        for matcher in [*matchers.matchers, *(m for group in matchers.or_matchers for m in group)]:
            if matcher.name == "__name__":
                if matcher.op != promql_parser.MatchOp.Equal:
                    raise ValueError(f"cannot check a {matcher.op} matcher on __name__: "
                                     f"{matcher.value!r}; spell the metric names out")
                names.add(matcher.value)
    elif isinstance(node, promql_parser.MatrixSelector):
        _collect(node.vector_selector, names)
    elif isinstance(node, promql_parser.BinaryExpr):
        _collect(node.lhs, names)
        _collect(node.rhs, names)
    elif isinstance(node, promql_parser.Call):
        for arg in node.args:
            _collect(arg, names)
    elif isinstance(node, promql_parser.AggregateExpr):
        _collect(node.expr, names)
        if node.param is not None:  # topk(k, ...), quantile(q, ...): may be an expression
            _collect(node.param, names)
    elif isinstance(node, (promql_parser.ParenExpr, promql_parser.UnaryExpr,
                           promql_parser.SubqueryExpr)):
        _collect(node.expr, names)
    elif not isinstance(node, (promql_parser.NumberLiteral, promql_parser.StringLiteral)):
        raise TypeError(f"unknown PromQL node {type(node).__name__}: {node}")

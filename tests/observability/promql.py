"""The PromQL of deploy/: dashboard targets and variables, alert rules, with Grafana's variables
substituted, shared by the static checks and the live Prometheus test."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources"
PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"

#: Grafana's own variables and the values the tests give them.
BUILTIN_VARS = {"__rate_interval": "15s", "__interval": "5s", "__range": "1m"}
#: Metrics only a GPU host has (NVML readings at scrape time); without one, expressions reading
#: them are checked for validity but not for data.
GPU_ONLY_METRICS = ("zenflow_nvml_gpu_utilization_ratio",)
#: Series that exist only once something has happened (a chat request, a skipped step, a job's end, a
#: Redis broker, a DPO or reinforcement job's step): expressions reading them are checked for validity,
#: and for data where they have any (the DPO and reinforcement gauges' data:
#: tests/observability/test_telemetry.py; a reinforcement job's series on a live worker:
#: tests/e2e/test_reinforcement_flow.py).
EVENT_METRICS = (
    "zenflow_inference_",
    "zenflow_dpo_",
    "zenflow_rft_",
    "zenflow_steps_skipped_total",
    "zenflow_worker_jobs_total",
    "zenflow_broker_queue_messages",
)
#: Where the service defines its metric families (prometheus_client constructors and collectors).
METRIC_SOURCES = (
    "api/core/prometheus.py",
    "serving/prometheus.py",
    "worker/metrics/telemetry.py",
    "worker/metrics/server.py",
)
_FAMILY = re.compile(
    r"\b(Counter|Gauge|Histogram|Summary|Info|GaugeMetricFamily|CounterMetricFamily|HistogramMetricFamily)"
    r"\(\s*\"([a-zA-Z_:][a-zA-Z0-9_:]*)\""
)


def exported_families() -> dict[str, str]:
    """Every metric family the code defines, as exposed (a counter's ``_total`` added) -> its kind."""
    found: dict[str, str] = {}
    for rel in METRIC_SOURCES:
        for kind, name in _FAMILY.findall((ROOT / rel).read_text()):
            if kind in ("Counter", "CounterMetricFamily") and not name.endswith("_total"):
                name += "_total"
            found[name] = kind
    return found


_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")


@dataclass(frozen=True)
class Expr:
    where: str
    expr: str

    def substituted(self, values: dict[str, str]) -> str:
        return substitute(self.expr, values)


def substitute(expr: str, values: dict[str, str]) -> str:
    def rep(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name in values:
            return values[name]
        if name in BUILTIN_VARS:
            return BUILTIN_VARS[name]
        raise KeyError(f"no value for ${name} in {expr!r}")

    return _VAR.sub(rep, expr)


def variables_in(expr: str) -> set[str]:
    return {m.group(1) or m.group(2) or m.group(3) for m in _VAR.finditer(expr)}


def load_dashboards() -> dict[Path, dict[str, Any]]:
    return {p: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def all_panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash.get("panels", []):
        out.append(p)
        out.extend(p.get("panels", []) or [])  # collapsed rows hold their panels
    return out


def dashboard_exprs(dash: dict[str, Any]) -> list[Expr]:
    out = []
    for p in all_panels(dash):
        for t in p.get("targets", []) or []:
            if t.get("expr"):
                out.append(Expr(f"panel {p.get('id')} {p.get('title')!r} {t.get('refId')}", t["expr"]))
    return out


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.+?)\s*,\s*)?(\w+)\s*\)\s*$")


def variable_queries(dash: dict[str, Any]) -> list[tuple[str, str | None, str]]:
    """(variable name, metric selector or None, label) of every ``label_values`` query variable."""
    out = []
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") != "query":
            continue
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        m = _LABEL_VALUES.match(q or "")
        if not m:
            raise AssertionError(f"variable {v.get('name')}: unsupported query {q!r}")
        out.append((v["name"], m.group(1), m.group(2)))
    return out


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


_CMP = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*(bool\s+)?-?[0-9.]+(e-?\d+)?\s*$")


def strip_condition(expr: str) -> str:
    """An alert condition without its final comparison with a number (``... > 0.2`` -> ``...``):
    what must return data while the system runs, whether or not the alert fires."""
    e = expr.strip()
    m = _CMP.search(e)
    return e[: m.start()].strip() if m else e

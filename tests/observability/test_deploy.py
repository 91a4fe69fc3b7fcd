"""deploy/ checked without servers: promtool on the config and the rules, the PromQL of the dashboard,
and the dashboard JSON and provisioning files as Grafana's file provisioning reads them."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.observability import promql
from tests.observability.promql import (
    ALERTS,
    DATASOURCES,
    PROM_CONFIG,
    PROVIDERS,
    alert_rules,
    all_panels,
    dashboard_exprs,
    load_dashboards,
    variable_queries,
    variables_in,
)
from tests.support import unavailable


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        unavailable(
            "promtool not installed (Debian package prometheus; scripts/bootstrap.sh installs it as root)"
        )
    return path


def _promtool_in(folder: Path, *args: str) -> str:
    """``promtool ARGS`` run in ``folder``; its output, once it succeeded."""
    out = subprocess.run([_promtool(), *args], cwd=folder, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def test_promtool_check_config() -> None:
    assert "SUCCESS" in _promtool_in(PROM_CONFIG.parent, "check", "config", PROM_CONFIG.name)


def test_promtool_check_rules() -> None:
    _promtool_in(ALERTS.parent, "check", "rules", ALERTS.name)


def test_promtool_test_rules_fire_the_alerts_and_only_them() -> None:
    """deploy/prometheus/alerts_test.yml: series that fire each queue, storage, broker and API alert,
    and series that must not."""
    tests = ALERTS.with_name("alerts_test.yml")
    _promtool_in(tests.parent, "test", "rules", tests.name)
    tested = set(re.findall(r"alertname: (\w+)", tests.read_text()))
    assert {
        "ZenflowQueueWithoutWorker",
        "ZenflowQueueBacklog",
        "ZenflowBrokerDown",
        "ZenflowDataVolumeFilling",
        "ZenflowApiServerErrors",
    } <= tested


def test_scrape_jobs_and_rules_files() -> None:
    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) >= {"zenflow-api", "zenflow-workers"}
    assert jobs["zenflow-api"].get("metrics_path", "/metrics") == "/metrics"
    for f in cfg["rule_files"]:
        assert (PROM_CONFIG.parent / f).is_file()
    # the alert rules name these scrape jobs
    text = ALERTS.read_text()
    assert 'job="zenflow-workers"' in text and 'job="zenflow-api"' in text


def test_alert_rules_shape() -> None:
    rules = alert_rules()
    names = {r["alert"] for r in rules}
    assert {"ZenflowStallFractionHigh", "ZenflowWorkerDown", "ZenflowJobFailed"} <= names
    for r in rules:
        assert r.get("for"), f"{r['alert']}: no for:"
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert r["annotations"].get("summary") and r["annotations"].get("description"), r["alert"]
        assert "job_id" not in r["expr"], "alerts must not depend on per-job series"


def test_every_promql_expression_parses(tmp_path: Path) -> None:
    """promtool parses the dashboard's expressions (variables substituted) as recording rules."""
    rules = []
    for dash in load_dashboards().values():
        values = {name: ".*" for name, _, _ in variable_queries(dash)}
        for e in dashboard_exprs(dash):
            rules.append({"record": f"zenflow_test:expr_{len(rules)}", "expr": e.substituted(values)})
    for r in alert_rules():
        rules.append({"record": f"zenflow_test:expr_{len(rules)}", "expr": promql.strip_condition(r["expr"])})
    f = tmp_path / "exprs.yml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "exprs", "rules": rules}]}))
    out = subprocess.run([_promtool(), "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _datasource_uids() -> dict[str, str]:
    uids = {}
    for f in DATASOURCES.glob("*.yml"):
        doc = yaml.safe_load(f.read_text())
        assert doc["apiVersion"] == 1
        for ds in doc["datasources"]:
            assert ds["uid"] and ds["type"] and ds["url"], ds
            uids[ds["uid"]] = ds["type"]
    return uids


def test_dashboard_provider_points_at_the_dashboards() -> None:
    providers = [p for f in PROVIDERS.glob("*.yml") for p in yaml.safe_load(f.read_text())["providers"]]
    assert providers
    for p in providers:
        assert p["type"] == "file"
        assert p["options"]["path"] == "/var/lib/grafana/dashboards"
    compose = promql.ROOT / "docker-compose.yml"
    if compose.exists():
        text = compose.read_text()
        assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards" in text
        assert "./deploy/grafana/provisioning:/etc/grafana/provisioning" in text
        assert "./deploy/prometheus:/etc/prometheus" in text


def test_dashboard_json_is_valid_for_provisioning() -> None:
    dashes = load_dashboards()
    assert dashes, "no dashboard JSON"
    ds_uids = _datasource_uids()
    seen_uids = set()
    for path, d in dashes.items():
        # what Grafana's file provisioner needs: a title, a stable uid, no database id of its own
        assert isinstance(d.get("title"), str) and d["title"].strip(), path
        assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", d.get("uid", "")), f"{path}: uid"
        assert d["uid"] not in seen_uids
        seen_uids.add(d["uid"])
        assert d.get("id") is None, f"{path}: a provisioned dashboard must not carry an id"
        assert isinstance(d.get("schemaVersion"), int) and d["schemaVersion"] >= 30
        assert isinstance(d.get("panels"), list) and d["panels"]

        variables = {v["name"]: v for v in d.get("templating", {}).get("list", [])}
        assert {"worker", "job_id"} <= set(variables), "fleet view by worker, per-job view by job_id"
        for name, v in variables.items():
            if v.get("type") == "query":
                assert v["datasource"]["uid"] in ds_uids, f"variable {name}: datasource"
        variable_queries(d)  # every query variable is a label_values() we can evaluate

        ids = [p["id"] for p in all_panels(d)]
        assert len(ids) == len(set(ids)), "panel ids must be unique"
        cells: set[tuple[int, int]] = set()
        for p in all_panels(d):
            gp = p["gridPos"]
            assert gp["w"] >= 1 and gp["h"] >= 1 and gp["x"] >= 0 and gp["x"] + gp["w"] <= 24, p["title"]
            for x in range(gp["x"], gp["x"] + gp["w"]):
                for y in range(gp["y"], gp["y"] + gp["h"]):
                    assert (x, y) not in cells, f"panel {p['title']!r} overlaps another"
                    cells.add((x, y))
            if p["type"] == "row":
                continue
            assert p.get("title"), p["id"]
            assert p["datasource"]["uid"] in ds_uids, f"panel {p['title']!r}: datasource uid"
            assert ds_uids[p["datasource"]["uid"]] == p["datasource"]["type"]
            targets = p.get("targets") or []
            assert targets, f"panel {p['title']!r} has no query"
            refs = [t["refId"] for t in targets]
            assert len(refs) == len(set(refs))
            for t in targets:
                assert t.get("expr"), f"panel {p['title']!r} {t['refId']}: no expr"
                if "datasource" in t:
                    assert t["datasource"]["uid"] == p["datasource"]["uid"]
                unknown = variables_in(t["expr"]) - set(variables) - set(promql.BUILTIN_VARS)
                assert not unknown, f"panel {p['title']!r}: undefined variables {unknown}"


def test_dashboard_covers_the_issue() -> None:
    (d,) = load_dashboards().values()
    text = " ".join(e.expr for e in dashboard_exprs(d))
    for metric in (
        "zenflow_gpu_utilization_ratio",
        "zenflow_stall_seconds_total",
        "zenflow_train_loss",
        "zenflow_tokens_total",
        "zenflow_queue_depth",
        "zenflow_jobs",
        "zenflow_cpu_optimizer_step_seconds",
        "zenflow_offload_transfer_bytes_total",
        "zenflow_device_memory_bytes",
        "zenflow_step_seconds_bucket",
        "http_request_duration_seconds_bucket",
        "zenflow_worker_current_job",
    ):
        assert metric in text, metric
    # the per-job view joins through the info gauge, never a job label on the step series
    job_exprs = [e.expr for e in dashboard_exprs(d) if "$job_id" in e.expr]
    assert job_exprs and all("zenflow_worker_current_job" in e for e in job_exprs)


#: Families exported but not charted, each with the reason (empty: every family has a panel).
NOT_CHARTED: dict[str, str] = {}
#: Families whose trouble pages someone: each is read by an alert rule.
PAGING = (
    "zenflow_db_up",
    "zenflow_steps_skipped_total",
    "zenflow_worker_jobs_total",
    "zenflow_inference_requests_total",
    "zenflow_stall_seconds_total",
    "zenflow_jobs",
    "zenflow_queue_workers",
    "zenflow_queue_oldest_wait_seconds",
    "zenflow_broker_up",
    "zenflow_data_free_bytes",
    "http_request_duration_seconds",
)


def _reads(expr: str, family: str, kind: str) -> bool:
    names = (
        [family]
        if kind not in ("Histogram", "HistogramMetricFamily")
        else [
            f"{family}_bucket",
            f"{family}_sum",
            f"{family}_count",
        ]
    )
    return any(re.search(rf"\b{re.escape(n)}\b", expr) for n in names)


def test_every_exported_family_is_charted_or_listed() -> None:
    families = promql.exported_families()
    # the scan finds the families docs/observability.md documents (a sanity check of the scan itself)
    assert {
        "zenflow_inference_requests_total",
        "zenflow_engine_host_memory_bytes",
        "zenflow_steps_skipped_total",
        "zenflow_db_up",
        "zenflow_worker_jobs_total",
        "http_request_duration_seconds",
        "zenflow_step_seconds",
    } <= set(families), sorted(families)
    exprs = [e.expr for d in load_dashboards().values() for e in dashboard_exprs(d)]
    exprs += [v for d in load_dashboards().values() for v in _variable_defs(d)]
    uncharted = sorted(
        f
        for f, kind in families.items()
        if f not in NOT_CHARTED and not any(_reads(e, f, kind) for e in exprs)
    )
    assert not uncharted, f"exported, not charted, not in NOT_CHARTED: {uncharted}"
    stale = sorted(set(NOT_CHARTED) - set(families))
    assert not stale, f"NOT_CHARTED names families the code no longer exports: {stale}"
    docs = (promql.ROOT / "docs" / "observability.md").read_text()
    undocumented = sorted(f for f in families if f"`{f}`" not in docs)
    assert not undocumented, f"not in docs/observability.md: {undocumented}"


def _variable_defs(d: dict[str, Any]) -> list[str]:
    return [str(v.get("definition", "")) for v in d.get("templating", {}).get("list", [])]


def test_paging_families_have_alerts() -> None:
    families = promql.exported_families()
    rules = alert_rules()
    for family in PAGING:
        assert family in families, family
        assert any(_reads(r["expr"], family, families[family]) for r in rules), f"no alert reads {family}"
    names = {r["alert"] for r in rules}
    assert {
        "ZenflowStepsSkipped",
        "ZenflowWorkerFailingJobs",
        "ZenflowInferenceErrors",
        "ZenflowInferenceRejecting",
        "ZenflowDatabaseUnreachable",
    } <= names

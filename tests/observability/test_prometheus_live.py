"""A real Prometheus scrapes the API and a running worker during a job; every PromQL expression of the
dashboard (its variables substituted: the worker, the running job) and of the alert rules returns data.

Alert rules are conditions (``... > 0.2``): what must return data is the expression with its final
comparison removed (the alert's input exists whether or not it fires); the full rule must also load and
be evaluated by Prometheus without error (its health is ``ok``). Expressions over GPU-only metrics
(NVML readings) are checked for data only where NVML sees a GPU; elsewhere they must still evaluate.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.faults.harness import Client, free_port, job_params, stack, wait_until
from tests.observability import promql
from tests.observability.promserver import PrometheusServer, make_config, prometheus_binary

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WORKER = "obs-worker-1"


def _gpu_present() -> bool:
    from worker.metrics.nvml import Nvml

    return Nvml().available()


def test_prometheus_scrapes_a_worker_during_a_job(tmp_path: Path) -> None:
    prometheus_binary()
    with stack(tmp_path, prefix="zf_obs") as st:
        api = st.start_api()
        port = free_port()
        st.start_worker(WORKER, metrics_port=port)
        cfg = make_config(
            {"zenflow-api": [api.removeprefix("http://")], "zenflow-workers": [f"127.0.0.1:{port}"]},
            tmp_path / "prom",
        )
        prom = PrometheusServer.start(cfg, tmp_path / "prom")
        try:
            _, key = st.create_team_key()
            c = Client(api, key)
            file_id = c.upload()
            job_id = c.create_job(file_id, **job_params(3000, checkpoint_every=1000))

            # the job runs on the worker and Prometheus sees it there
            wait_until(
                lambda: prom.query(f'zenflow_worker_current_job{{job_id="{job_id}"}} == 1'),
                120,
                "the running job in Prometheus",
                interval=0.5,
            )
            wait_until(
                lambda: prom.query(f'zenflow_step_seconds_count{{worker="{WORKER}"}} > 20'),
                120,
                "steps in Prometheus",
                interval=0.5,
            )
            wait_until(
                lambda: prom.query(
                    f'increase(zenflow_cpu_optimizer_step_seconds_count{{worker="{WORKER}"}}[15s]) > 0'
                ),
                60,
                "CPU optimizer steps in Prometheus",
                interval=0.5,
            )
            for _ in range(5):  # API traffic for the latency panels
                c.http.get("/v1/fine_tuning/jobs").raise_for_status()
                c.http.get(f"/v1/fine_tuning/jobs/{job_id}").raise_for_status()
            time.sleep(3)  # a few scrapes of that traffic, and rate windows of >= 2 samples
            assert st.job(job_id).status == "running", "the job must still run while we query"

            up = {t["labels"]["job"]: t["health"] for t in prom.targets()}
            assert up == {"zenflow-api": "up", "zenflow-workers": "up"}, prom.targets()

            gpu = _gpu_present()
            missing = []
            for dash in promql.load_dashboards().values():
                values = {"worker": WORKER, "job_id": job_id}
                for name, match, label in promql.variable_queries(dash):
                    got = prom.label_values(label, match)
                    assert values[name] in got, f"variable {name}: {got}"
                for e in promql.dashboard_exprs(dash):
                    q = e.substituted(values)
                    res = prom.query(q)  # raises on a query error
                    sparse = promql.EVENT_METRICS + (() if gpu else promql.GPU_ONLY_METRICS)
                    if not res and not any(m in q for m in sparse):
                        missing.append(f"{e.where}: {q}")
            for r in promql.alert_rules():
                q = promql.strip_condition(r["expr"])
                if not prom.query(q) and not any(m in q for m in promql.EVENT_METRICS):
                    missing.append(f"alert {r['alert']}: {q}")
            assert not missing, "expressions without data:\n" + "\n".join(missing)

            # the rules are loaded and evaluated without error
            def evaluated() -> list:
                rs = prom.rules()
                return (
                    rs
                    if rs and all(not r.get("lastEvaluation", "0001").startswith("0001") for r in rs)
                    else []
                )

            rules = wait_until(evaluated, 30, "rule evaluation")
            assert {r["name"] for r in rules} >= {
                "ZenflowStallFractionHigh",
                "ZenflowWorkerDown",
                "ZenflowJobFailed",
            }
            bad = [(r["name"], r.get("lastError")) for r in prom.rules() if r["health"] != "ok"]
            assert not bad, bad

            # when the job ends (cancelled here, to keep the test short) its info series goes away;
            # the worker's totals stay
            c.http.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").raise_for_status()
            st.wait_status(job_id, {"cancelled"}, 120)
            wait_until(
                lambda: not prom.query(f'zenflow_worker_current_job{{job_id="{job_id}"}} == 1'),
                30,
                "the finished job to leave zenflow_worker_current_job",
                interval=0.5,
            )
            assert prom.query(f'zenflow_tokens_total{{worker="{WORKER}"}} > 0')
            wait_until(
                lambda: prom.query(
                    f'zenflow_worker_jobs_total{{worker="{WORKER}", status="cancelled"}} == 1'
                ),
                10,
                "the cancelled job counted by the worker",
            )
            wait_until(
                lambda: prom.query('max(zenflow_jobs{status="cancelled"}) == 1'), 10, "the cancelled count"
            )
            # and the worker's own exposition drops it once the runner process has exited
            wait_until(
                lambda: job_id not in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text,
                30,
                "the runner's live series to be dropped",
                interval=0.5,
            )
        except BaseException:
            print(st.logs())
            print(prom.proc.tail())
            raise
        finally:
            prom.stop()

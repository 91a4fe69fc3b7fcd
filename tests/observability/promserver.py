"""A real Prometheus server (Debian's package) for tests: a temp config and TSDB, a free loopback port."""

from __future__ import annotations

import copy
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.faults.harness import Proc, free_port, wait_until
from tests.observability.promql import ALERTS, PROM_CONFIG
from tests.support import unavailable


def prometheus_binary() -> str:
    exe = shutil.which("prometheus")
    if exe is None:
        unavailable(
            "prometheus not installed (Debian package prometheus; scripts/bootstrap.sh installs it as root)"
        )
    return exe


def make_config(targets: dict[str, list[str]], tmp: Path, *, interval: str = "1s") -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with its scrape jobs pointed at ``targets`` (job name -> host:port),
    fast intervals, and deploy's alert rules. Workers are given through file discovery, as in production."""
    cfg = copy.deepcopy(yaml.safe_load(PROM_CONFIG.read_text()))
    cfg["global"].update(scrape_interval=interval, evaluation_interval=interval, scrape_timeout=interval)
    cfg["rule_files"] = [str(ALERTS)]
    sd = tmp / "targets"
    sd.mkdir(parents=True, exist_ok=True)
    for job in cfg["scrape_configs"]:
        name = job["job_name"]
        if "file_sd_configs" in job:
            (sd / f"workers-{name}.yml").write_text(yaml.safe_dump([{"targets": targets.get(name, [])}]))
            job["file_sd_configs"] = [{"files": [str(sd / "workers-*.yml")], "refresh_interval": "1s"}]
            job.pop("static_configs", None)
        else:
            job["static_configs"] = [{"targets": targets.get(name, [])}]
    return cfg


@dataclass
class PrometheusServer:
    proc: Proc
    url: str

    @classmethod
    def start(cls, config: dict[str, Any], tmp: Path) -> PrometheusServer:
        exe = prometheus_binary()
        tmp.mkdir(parents=True, exist_ok=True)
        cfg_path = tmp / "prometheus.yml"
        cfg_path.write_text(yaml.safe_dump(config))
        port = free_port()
        cmd = [
            exe,
            f"--config.file={cfg_path}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
            "--storage.tsdb.retention.time=1h",
        ]
        import os

        proc = Proc.start(f"prometheus-{port}", cmd, env=dict(os.environ), log_dir=tmp, cwd=tmp)
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if not proc.alive():
                raise AssertionError(f"prometheus exited:\n{proc.tail()}")
            return httpx.get(url + "/-/ready", timeout=1).status_code == 200

        wait_until(ready, 60, "prometheus to be ready")
        return cls(proc, url)

    def stop(self) -> None:
        self.proc.stop()

    def api(self, path: str, **params: Any) -> Any:
        r = httpx.get(self.url + path, params=params, timeout=10)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("/api/v1/query", query=expr, time=f"{time.time():.3f}")
        assert data["resultType"] in ("vector", "scalar", "matrix"), data
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def label_values(self, label: str, match: str | None) -> list[str]:
        params = {"match[]": match} if match else {}
        return self.api(f"/api/v1/label/{label}/values", **params)

    def targets(self) -> list[dict[str, Any]]:
        return self.api("/api/v1/targets")["activeTargets"]

    def rules(self) -> list[dict[str, Any]]:
        return [r for g in self.api("/api/v1/rules")["groups"] for r in g["rules"]]

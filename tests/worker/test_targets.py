"""worker.targets: ``python -m worker`` writes its GPU workers' /metrics endpoints for Prometheus (one per
GPU, the launcher's ports), removes them when it stops, and its healthcheck finds a worker that does not
answer; deploy/prometheus/prometheus.yml, run by a real Prometheus, scrapes what it wrote."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from store.settings import get_settings
from trainer.run.launch import free_port
from worker import launcher, targets


@pytest.fixture
def targets_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    folder = tmp_path / "zenflow-targets"
    monkeypatch.setenv("ZENFLOW_WORKER_TARGETS_DIR", str(folder))
    monkeypatch.setenv("ZENFLOW_WORKER_METRICS_PORT", "9101")
    monkeypatch.setenv("ZENFLOW_WORKER_ADDRESS", "worker")
    monkeypatch.setenv("ZENFLOW_DATA_DIR", str(tmp_path / "var"))
    get_settings.cache_clear()
    yield folder
    get_settings.cache_clear()


def test_the_launcher_publishes_a_target_per_gpu_worker_while_it_runs(
    targets_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def spawn(groups: list[Any], per_job: int, args: Any, settings: Any) -> int:
        seen["groups"] = groups
        seen["files"] = {p.name: json.loads(p.read_text()) for p in targets_env.iterdir()}
        return 0

    monkeypatch.setattr(launcher, "detect_gpus", lambda: [(0, "h100"), (1, "h100"), (2, "h100")])
    monkeypatch.setattr(launcher, "_spawn_workers", spawn)
    assert launcher.main(["--gpus", "auto"]) == 0
    assert len(seen["groups"]) == 3
    assert seen["files"] == {
        "workers-worker.json": [
            {
                "targets": ["worker:9101", "worker:9102", "worker:9103"],  # the ports _spawn_workers gives
                "labels": {"zenflow_host": "worker"},
            }
        ]
    }
    assert list(targets_env.iterdir()) == []  # stopped: no target left to show down


def test_nothing_is_written_without_a_folder_or_a_metrics_port(
    targets_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZENFLOW_WORKER_METRICS_PORT", "0")
    get_settings.cache_clear()
    assert targets.publish(2) is None
    monkeypatch.setenv("ZENFLOW_WORKER_METRICS_PORT", "9101")
    monkeypatch.setenv("ZENFLOW_WORKER_TARGETS_DIR", "")
    get_settings.cache_clear()
    assert targets.publish(2) is None and not targets_env.exists()


def _metrics_server() -> int:
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    registry = CollectorRegistry()
    Gauge("zenflow_test_up", "a test gauge", registry=registry).set(1)
    port = free_port()
    start_http_server(port, addr="127.0.0.1", registry=registry)
    return port


def test_the_healthcheck_asks_every_listed_worker(targets_env: Path) -> None:
    live = _metrics_server()
    targets.write_targets(targets_env, "worker", [live])
    assert targets.main(["--check"]) == 0
    dead = free_port()
    targets.write_targets(targets_env, "worker", [live, dead])
    problem = targets.check(targets_env, "worker")
    assert problem is not None and problem.startswith(f"worker:{dead}:")
    assert targets.main(["--check"]) == 1
    (targets_env / "workers-worker.json").unlink()
    assert targets.main(["--check"]) == 1  # no file: the launcher never got as far as its workers


@pytest.mark.slow
def test_prometheus_scrapes_the_workers_the_launcher_wrote(tmp_path: Path) -> None:
    """deploy/prometheus/prometheus.yml as compose mounts it, its generated-targets folder pointed at a
    temp one: a target file written there becomes a zenflow-workers target that is up, no reload."""
    from tests.observability.promql import ALERTS, PROM_CONFIG
    from tests.observability.promserver import PrometheusServer

    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    cfg["rule_files"] = [str(ALERTS)]
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    folder = tmp_path / "zenflow-targets"
    folder.mkdir()
    job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "zenflow-workers")
    sd = job["file_sd_configs"]
    generated = [c for c in sd if c["files"] == ["/zenflow-targets/workers-*.json"]]
    assert generated, sd  # the compose volume's path (docker-compose.yml mounts worker-targets there)
    generated[0]["files"] = [str(folder / "workers-*.json")]
    prom = PrometheusServer.start(cfg, tmp_path / "prom")
    try:
        port = _metrics_server()
        targets.write_targets(folder, "127.0.0.1", [port])
        deadline = time.monotonic() + 60
        while True:
            up = [
                t
                for t in prom.targets()
                if t["labels"].get("job") == "zenflow-workers" and t["health"] == "up"
            ]
            if up:
                break
            assert time.monotonic() < deadline, prom.targets()
            time.sleep(0.5)
        assert up[0]["labels"]["instance"] == f"127.0.0.1:{port}"
        assert up[0]["labels"]["zenflow_host"] == "127.0.0.1"
    finally:
        prom.stop()

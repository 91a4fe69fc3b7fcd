"""API metrics: latency by route template, job counts at scrape time, graceful DB failure."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import sessionmaker

from api.core.prometheus import JobsCollector, install_metrics, metrics_registry, request_duration_histogram
from store.db import make_engine
from store.orm import Base, File, FineTuningJob, Team
from store.settings import Settings
from tests.support import unavailable

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def db(tmp_path: Path):
    engine = make_engine(f"sqlite:///{tmp_path / 'm.db'}")
    Base.metadata.create_all(engine)
    sm = sessionmaker(bind=engine, expire_on_commit=False)
    with sm() as s:
        team = Team(name="t")
        s.add(team)
        s.flush()
        f = File(
            team_id=team.id,
            filename="a.jsonl",
            purpose="fine-tune",
            bytes=1,
            sha256="0" * 64,
            storage_path="x",
        )
        s.add(f)
        s.flush()
        for status, queue in [
            ("queued", "gpu-default"),
            ("queued", "gpu-h200"),
            ("queued", "gpu-default"),
            ("running", "gpu-default"),
            ("failed", "gpu-default"),
            ("paused", "gpu-default"),  # neither running nor waiting: not in the queue depth
        ]:
            s.add(
                FineTuningJob(
                    team_id=team.id, model="tiny", training_file_id=f.id, status=status, queue=queue
                )
            )
        s.commit()
    yield sm
    engine.dispose()


def _app(sm) -> FastAPI:
    app = FastAPI()
    app.state.sessionmaker = sm
    app.state.settings = Settings(broker_url="memory://")

    @app.get("/v1/things/{thing_id}")
    def get_thing(thing_id: int) -> dict:
        if thing_id == 404:
            raise HTTPException(404, "no such thing")
        return {"id": thing_id}

    @app.get("/boom")
    def boom() -> dict:
        raise RuntimeError("boom")

    install_metrics(app)
    install_metrics(app)  # idempotent
    return app


def _hist_count(route: str, method: str, status: str) -> float:
    v = REGISTRY.get_sample_value(
        "http_request_duration_seconds_count", {"route": route, "method": method, "status": status}
    )
    return v or 0.0


def _fams(text: str):
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_latency_by_route_template_and_status(db) -> None:
    app = _app(db)
    tpl = "/v1/things/{thing_id}"
    before = {
        k: _hist_count(*k)
        for k in [
            (tpl, "GET", "200"),
            (tpl, "GET", "404"),
            ("unmatched", "GET", "404"),
            ("/boom", "GET", "500"),
            (tpl, "GET", "422"),
        ]
    }
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.get("/v1/things/1").status_code == 200
        assert c.get("/v1/things/2").status_code == 200
        assert c.get("/v1/things/404").status_code == 404
        assert c.get("/v1/things/abc").status_code == 422
        assert c.get(f"/random/{uuid.uuid4()}").status_code == 404
        assert c.get("/boom").status_code == 500
    assert _hist_count(tpl, "GET", "200") - before[(tpl, "GET", "200")] == 2
    assert _hist_count(tpl, "GET", "404") - before[(tpl, "GET", "404")] == 1
    assert _hist_count(tpl, "GET", "422") - before[(tpl, "GET", "422")] == 1
    assert _hist_count("unmatched", "GET", "404") - before[("unmatched", "GET", "404")] == 1
    assert _hist_count("/boom", "GET", "500") - before[("/boom", "GET", "500")] == 1
    routes = {
        s.labels["route"]
        for m in REGISTRY.collect()
        if m.name == "http_request_duration_seconds"
        for s in m.samples
    }
    assert not any(r.startswith("/random") for r in routes), "raw paths must not become label values"


def test_metrics_endpoint_jobs_and_queue(db) -> None:
    app = _app(db)
    with TestClient(app) as c:
        r = c.get("/metrics")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain")
        assert "/metrics" not in c.get("/openapi.json").json()["paths"]
    f = _fams(r.text)
    jobs = {s.labels["status"]: s.value for s in f["zenflow_jobs"].samples}
    assert jobs == {
        "validating_files": 0,
        "queued": 3,
        "running": 1,
        "paused": 1,
        "succeeded": 0,
        "failed": 1,
        "cancelled": 0,
    }
    depth = {s.labels["queue"]: s.value for s in f["zenflow_queue_depth"].samples}
    assert depth == {"gpu-default": 2, "gpu-h200": 1}
    assert f["zenflow_db_up"].samples[0].value == 1
    assert "http_request_duration_seconds" in f
    assert "zenflow_broker_queue_messages" not in f  # memory:// broker: no list to read
    names = [line.split()[2] for line in r.text.splitlines() if line.startswith("# TYPE")]
    assert len(names) == len(set(names))


def test_queue_workers_and_longest_wait(db) -> None:
    """Per queue: the live workers consuming it (a stale heartbeat is not live) and how long its
    longest-waiting job has waited since it was dispatched."""
    from sqlalchemy import select

    from store import worker_registry
    from store.orm import utcnow

    now = utcnow()
    with db() as s:
        worker_registry.register(s, "gpu0@a", ["gpu-h200", "gpu-default"], {})
        worker_registry.register(s, "gpu0@b", ["gpu-h200"], {})
        worker_registry.register(s, "gpu0@gone", ["gpu-a100"], {}, now=now - timedelta(hours=1))
        waiting = s.scalars(select(FineTuningJob).where(FineTuningJob.queue == "gpu-h200")).one()
        waiting.dispatched_at = now - timedelta(seconds=600)
        s.commit()
    col = JobsCollector(db, lambda: Settings(broker_url="memory://", worker_live_seconds=120))
    fams = {m.name: m for m in col.collect()}
    workers = {x.labels["queue"]: x.value for x in fams["zenflow_queue_workers"].samples}
    assert workers == {"gpu-default": 1, "gpu-h200": 2}  # gpu-a100's only worker is not live
    wait = {x.labels["queue"]: x.value for x in fams["zenflow_queue_oldest_wait_seconds"].samples}
    assert 600 <= wait["gpu-h200"] < 660 and 0 <= wait["gpu-default"] < 60, wait


def test_data_volumes_and_the_builtin_cache(tmp_path: Path) -> None:
    from api.builtin_cache import BuiltinCache
    from api.core.prometheus import StorageCollector

    settings = Settings(data_dir=tmp_path)
    settings.resolved_files_dir.mkdir(parents=True)
    settings.resolved_jobs_dir.mkdir(parents=True)
    reg = metrics_registry(
        None, StorageCollector(lambda: settings, lambda: BuiltinCache(tmp_path / "b", 1000))
    )
    for volume in ("files", "jobs"):
        free = reg.get_sample_value("zenflow_data_free_bytes", {"volume": volume})
        size = reg.get_sample_value("zenflow_data_size_bytes", {"volume": volume})
        assert free is not None and size is not None and 0 <= free <= size and size > 0, volume
    assert reg.get_sample_value("zenflow_builtin_cache_bytes") == 0
    assert reg.get_sample_value("zenflow_builtin_cache_budget_bytes") == 1000


def test_database_down_scrape_still_answers() -> None:
    def broken():
        raise OSError("connection refused")

    reg = metrics_registry(JobsCollector(broken))
    assert reg.get_sample_value("zenflow_db_up") == 0
    assert reg.get_sample_value("zenflow_jobs", {"status": "queued"}) is None


@pytest.mark.services  # the local Redis
def test_broker_queue_length_from_redis(db) -> None:
    redis = pytest.importorskip("redis")
    url = "redis://127.0.0.1:6379/15"
    try:
        client = redis.Redis.from_url(url, socket_timeout=1)
        client.ping()
    except Exception as e:  # pragma: no cover - CI starts Redis
        unavailable(f"no local Redis: {e}")
    q = f"zf-test-{uuid.uuid4().hex[:8]}"
    client.rpush(q, "a", "b")
    try:
        col = JobsCollector(db, lambda: Settings(broker_url=url, default_queue=q))
        fams = {m.name: m for m in col.collect()}
        got = {s.labels["queue"]: s.value for s in fams["zenflow_broker_queue_messages"].samples}
        assert got[q] == 2 and fams["zenflow_broker_up"].samples[0].value == 1
    finally:
        client.delete(q)
    gone = JobsCollector(db, lambda: Settings(broker_url="redis://127.0.0.1:1/0", default_queue=q))
    fams = {m.name: m for m in gone.collect()}
    assert fams["zenflow_broker_up"].samples[0].value == 0 and "zenflow_broker_queue_messages" not in fams


def test_multiprocess_dir_is_merged(tmp_path: Path, monkeypatch) -> None:
    mp = tmp_path / "mp"
    mp.mkdir()
    child = textwrap.dedent(
        """
        from api.core.prometheus import request_duration_histogram
        request_duration_histogram().labels("/v1/x", "GET", "200").observe(0.003)
        """
    )
    reader = textwrap.dedent(
        """
        from api.core.prometheus import metrics_registry
        reg = metrics_registry(None)
        labels = {"route": "/v1/x", "method": "GET", "status": "200"}
        print(reg.get_sample_value("http_request_duration_seconds_count", labels),
              reg.get_sample_value("http_request_duration_seconds_bucket", {**labels, "le": "0.005"}))
        """
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp), "PYTHONPATH": str(ROOT)}
    for _ in range(2):  # two server processes
        subprocess.run([sys.executable, "-c", child], env=env, cwd=ROOT, check=True, timeout=60)
    out = subprocess.run(
        [sys.executable, "-c", reader],
        env=env,
        cwd=ROOT,
        check=True,
        timeout=60,
        capture_output=True,
        text=True,
    )
    assert out.stdout.split() == ["2.0", "2.0"]
    # a process whose own metrics are in memory keeps serving them, whatever the variable says later
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(mp))
    request_duration_histogram().labels("/v1/inproc", "GET", "200").observe(0.001)
    reg = metrics_registry(None)
    assert (
        reg.get_sample_value(
            "http_request_duration_seconds_count", {"route": "/v1/inproc", "method": "GET", "status": "200"}
        )
        >= 1
    )

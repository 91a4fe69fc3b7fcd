"""End to end against real PostgreSQL, Redis and a real Celery worker: upload -> create -> run ->
succeeded -> checkpoints listed -> the model loads. And ``zenflow serve`` on embedded defaults."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import os
import secrets
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from store.settings import Settings
from tests.api.conftest import TEST_API_SETTINGS, ServerThread, free_port, make_team

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def flow_settings(settings: Settings, tmp_path: Path) -> Iterator[Settings]:
    import redis

    queue = f"zf-test-flow-{secrets.token_hex(4)}"
    yield settings.model_copy(update={"default_queue": queue, "data_dir": tmp_path / "var"})
    r = redis.Redis.from_url(settings.broker_url)
    for key in r.scan_iter(f"*{queue}*"):
        r.delete(key)


@contextlib.contextmanager
def running_worker(
    settings: Settings, tmp_path: Path, name: str, **extra_env: str
) -> Iterator[subprocess.Popen[bytes]]:
    """A real Celery worker process on ``settings``' database, broker, data dir and queue (its log in
    ``tmp_path/worker.log``), with none of this process's ZENFLOW_/WANDB_/MLFLOW_ settings but
    ``extra_env`` (which may override the defaults below); stopped on exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZENFLOW_", "WANDB_", "MLFLOW_"))}
    env.update(
        ZENFLOW_DATABASE_URL=settings.database_url,
        ZENFLOW_BROKER_URL=settings.broker_url,
        ZENFLOW_DATA_DIR=str(settings.data_dir),
        ZENFLOW_DEFAULT_QUEUE=settings.default_queue,
        ZENFLOW_HEARTBEAT_INTERVAL_SECONDS="2",
        # The API tests' jobs in this database were "enqueued" by a recorder, never to Redis: the
        # worker's reaper is not to send them (worker.dispatch; tested in tests/worker/test_dispatch.py).
        ZENFLOW_DISPATCH_GRACE_SECONDS="86400",
    )
    env.update(extra_env)
    log = (tmp_path / "worker.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "--app=worker:celery_app",
            "worker",
            "--pool=solo",
            "--concurrency=1",
            f"--queues={settings.default_queue}",
            f"--hostname={name}-{secrets.token_hex(3)}@%h",
            "--without-gossip",
            "--without-mingle",
            "--loglevel=INFO",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        _stop(proc)
        log.close()


@pytest.fixture
def celery_worker(flow_settings: Settings, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    with running_worker(flow_settings, tmp_path, "flow") as proc:
        yield proc


def test_upload_create_run_succeed_checkpoints_model_loads(
    flow_settings: Settings, celery_worker, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    from api.app import create_app
    from trainer.samples import TRAIN_FILE, VALID_FILE
    from worker.broker import configure_celery

    configure_celery(flow_settings)
    app = create_app(flow_settings, TEST_API_SETTINGS)
    team = make_team(app)
    try:
        with (
            ServerThread(app) as server,
            httpx.Client(base_url=server.base_url, headers=team.headers, timeout=30) as http,
        ):
            ids = []
            for path in (TRAIN_FILE, VALID_FILE):
                r = http.post(
                    "/v1/files", data={"purpose": "fine-tune"}, files={"file": (path.name, path.read_bytes())}
                )
                assert r.status_code == 200, r.text
                ids.append(r.json()["id"])
            r = http.post(
                "/v1/fine_tuning/jobs",
                json={
                    "model": "tiny-llama",
                    "training_file": ids[0],
                    "validation_file": ids[1],
                    "seed": 1,
                    "hyperparameters": {
                        "n_epochs": 1,
                        "batch_size": 16,
                        "checkpoint_every": 4,
                        "eval_every": 4,
                    },
                    "engine": {"mode": "auto", "topk_ratio": 0.1, "update_interval": 2},
                },
            )
            assert r.status_code == 200, r.text
            job_id = r.json()["id"]

            messages, deadline, running = [], time.monotonic() + 600, None
            with http.stream(
                "GET",
                f"/v1/fine_tuning/jobs/{job_id}/events",
                params={"stream": "true"},
                timeout=httpx.Timeout(30, read=600),
            ) as resp:
                for line in resp.iter_lines():
                    if line == "data: [DONE]" or time.monotonic() > deadline:
                        break
                    if line.startswith("data: "):
                        messages.append(json.loads(line[6:])["message"])
                        if running is None and messages[-1].startswith("Step "):
                            running = http.get(f"/v1/fine_tuning/jobs/{job_id}").json()
            # the running job shows its engine as resolved (never auto), with where each value came from
            assert running is not None and running["status"] == "running", running
            engine, sources = running["engine"], running["sources"]
            assert engine["mode"] in ("device", "offload", "zenflow") and sources["engine.mode"] == "plan"
            assert engine["topk_ratio"] == 0.1 and sources["engine.topk_ratio"] == "request"
            assert {f"engine.{k}" for k in engine} <= set(sources) and "auto" not in engine.values()
            job = http.get(f"/v1/fine_tuning/jobs/{job_id}").json()
            assert job["status"] == "succeeded", (
                job,
                messages[-10:],
                (tmp_path / "worker.log").read_text()[-3000:],
            )
            assert job["finished_at"] and job["trained_tokens"] and job["fine_tuned_model"]
            assert job["hyperparameters"]["n_epochs"] == 1 and job["hyperparameters"]["batch_size"] == 16
            assert job["progress"]["step"] == job["progress"]["total_steps"] == 8
            assert any(m.startswith("Job succeeded") for m in messages)

            ck = http.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()
            assert ck["data"], ck
            assert ck["data"][0]["step_number"] == 8 and ck["data"][0]["metrics"]["train_loss"] is not None
            steps = [c["step_number"] for c in ck["data"]]
            assert steps == sorted(steps, reverse=True)
            m = http.get(f"/v1/fine_tuning/jobs/{job_id}/metrics").json()
            assert [x["step"] for x in m["data"]] == list(range(1, 9))
            assert all(0.0 <= x["stall_fraction"] <= 1.0 for x in m["data"])
            ev = http.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 1}).json()
            assert ev["data"][0]["created_at"] and ev["has_more"]

            # result_files: the metrics CSV, a file of the team (OpenAI's step/train_loss/valid_loss first)
            assert len(job["result_files"]) == 1, job
            rf = http.get(f"/v1/files/{job['result_files'][0]}").json()
            assert rf["purpose"] == "fine-tune-results" and rf["filename"] == "step_metrics.csv"
            content = http.get(f"/v1/files/{rf['id']}/content")
            assert content.status_code == 200 and len(content.content) == rf["bytes"]
            table = list(csv.DictReader(io.StringIO(content.text)))
            assert list(table[0])[:3] == ["step", "train_loss", "valid_loss"]
            assert [int(r["step"]) for r in table] == list(range(1, 9))
            assert float(table[-1]["train_loss"]) == pytest.approx(m["data"][-1]["train_loss"])
            assert table[3]["valid_loss"] and float(table[3]["valid_loss"]) > 0  # evaluated at step 4
            r = http.post("/v1/fine_tuning/jobs", json={"model": "tiny-llama", "training_file": rf["id"]})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_file_purpose"

            # the model by its ft: id, downloaded as a tar (api.model_download)
            assert job["fine_tuned_model"] == f"ft:tiny-llama:{team.name}::{job_id}"
            tar = http.get(f"/v1/models/{job['fine_tuned_model']}/content")
            assert (
                tar.status_code == 200
                and tar.headers["x-checksum-sha256"] == hashlib.sha256(tar.content).hexdigest()
            )
            with tarfile.open(fileobj=io.BytesIO(tar.content)) as archive:
                archive.extractall(tmp_path / "model", filter="data")

        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", local_files_only=True)
        with torch.no_grad():
            out = model(torch.tensor([[1, 2, 3, 4]]))
        assert torch.isfinite(out.logits).all()
    finally:
        configure_celery()
        app.state.engine.dispose()


def test_zenflow_serve_embedded_is_ready(tmp_path: Path) -> None:
    """One command, no PostgreSQL or Redis: SQLite + Celery on kombu's SQLAlchemy transport."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZENFLOW_")}
    env["ZENFLOW_DATA_DIR"] = str(tmp_path / "var")
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "api.cli.main", "serve", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline, status = time.monotonic() + 90, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
                status = r.status_code
                if status == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert status == 200, (tmp_path / "serve.log").read_text()[-3000:]
        assert (tmp_path / "var" / "zenflow.db").is_file() and (tmp_path / "var" / "broker.db").is_file()
    finally:
        _stop(proc, signal.SIGTERM)  # docker stop: a clean shutdown, worker stopped, exit status 0
        log.close()
    assert proc.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]

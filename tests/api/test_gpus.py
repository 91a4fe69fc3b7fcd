"""Multi-GPU jobs at the API: ``resources: {"gpus": N}`` is checked, stored, shown and routed to the
queue of its size (``<default>-x<N>``); a job larger than every live worker runs (``worker_registry.gpus_per_job``)
or with fewer examples per step than ranks is refused with nothing written; migration 0007 adds and
removes the two columns. The slow end-to-end test runs such a job on the embedded server (CPU ranks)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import inspect, text, update
from sqlalchemy.orm import Session

from api import migrate
from store import worker_registry
from store.db import make_engine, session_scope
from store.orm import FineTuningJob, JobEvent, Team, Worker, utcnow
from store.settings import Settings
from tests.api.conftest import Enqueued, TeamKey, chat_jsonl, error_of, free_port, team_rows, uploaded_id
from tests.support import create_database, drop_database, stop_process_group
from trainer.plan.gpus import GiB
from worker.capacity.measure import WorkerCapacity

#: A box every tiny job fits (capacity admission is not what these tests are about).
BIG = WorkerCapacity(
    device_type="cuda",
    gpu_name="NVIDIA H100 80GB HBM3",
    gpu_memory_bytes=80 * GiB,
    gpus_on_host=8,
    host_memory_bytes=1024 * GiB,
    cores=64,
    cpu_adam_gbps=40.0,
    pcie_gbps=50.0,
)

Register = Callable[..., None]


@pytest.fixture
def register(pg_url: str) -> Iterator[Register]:
    """Register live workers (``gpus_per_job`` each, on the queue of that size); removed afterwards."""
    names: list[str] = []

    def add(name: str, gpus_per_job: int, queue: str) -> None:
        with session_scope(pg_url) as s:
            worker_registry.register(s, name, [queue], BIG.model_dump(mode="json"), gpus_per_job=gpus_per_job)
        names.append(name)

    yield add
    with session_scope(pg_url) as s:
        for name in names:
            worker_registry.unregister(s, name)


def _create(client: TestClient, team: TeamKey, file_id: str, resources: Any = None, **hp: Any) -> Any:
    body: dict[str, Any] = {
        "model": "tiny-llama",
        "training_file": file_id,
        "hyperparameters": {"n_epochs": 1, "batch_size": 4, **hp},
    }
    if resources is not None:
        body["resources"] = resources
    return client.post("/v1/fine_tuning/jobs", headers=team.headers, json=body)


def test_two_gpu_job_is_stored_shown_and_queued_by_size(
    client: TestClient, team: TeamKey, register: Register, settings: Settings, enqueued: Enqueued, pg_url: str
) -> None:
    x2 = f"{settings.default_queue}-x2"
    register("gpus-two@test", 2, x2)
    r = _create(client, team, uploaded_id(client, team), {"gpus": 2})
    assert r.status_code == 200, r.text
    job = r.json()
    assert (
        job["resources"] == {"gpus": 2, "nodes": 1}
        and job["status"] == "queued"
        and job["queue_position"] == 1
    )
    assert (job["id"], x2) in enqueued.calls
    with session_scope(pg_url) as s:
        row = s.get(FineTuningJob, job["id"])
        assert (
            row is not None
            and row.request.resources.model_dump(exclude_unset=True) == {"gpus": 2}
            and row.queue == x2
        )
        assert row.dispatched_at is not None
        events = [e.message for e in s.query(JobEvent).filter(JobEvent.job_id == job["id"])]
    assert f"Job queued on {x2}" in events
    got = client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=team.headers).json()
    assert got["resources"] == {"gpus": 2, "nodes": 1} and got["queue_position"] == 1
    listed = client.get("/v1/fine_tuning/jobs", headers=team.headers).json()["data"]
    assert [j["resources"] for j in listed] == [{"gpus": 2, "nodes": 1}]


def test_a_job_without_resources_runs_on_one_gpu_of_the_default_queue(
    client: TestClient, team: TeamKey, settings: Settings, enqueued: Enqueued, pg_url: str
) -> None:
    r = _create(client, team, uploaded_id(client, team))
    assert r.status_code == 200, r.text
    assert r.json()["resources"] == {"gpus": 1, "nodes": 1}
    assert (r.json()["id"], settings.default_queue) in enqueued.calls
    with session_scope(pg_url) as s:
        row = s.get(FineTuningJob, r.json()["id"])
        assert (
            row is not None
            and "resources" not in row.request.model_fields_set
            and row.queue == settings.default_queue
        )
    # an explicit one GPU is the same queue
    r = _create(client, team, uploaded_id(client, team), {"gpus": 1})
    assert r.status_code == 200 and r.json()["resources"] == {"gpus": 1, "nodes": 1}
    assert (r.json()["id"], settings.default_queue) in enqueued.calls


def test_more_gpus_than_any_live_worker_runs_is_refused_and_writes_nothing(
    client: TestClient, team: TeamKey, register: Register, settings: Settings, enqueued: Enqueued
) -> None:
    register("gpus-one@test", 1, settings.default_queue)
    register("gpus-two-b@test", 2, f"{settings.default_queue}-x2")
    file_id = uploaded_id(client, team)
    calls = len(enqueued.calls)
    r = _create(client, team, file_id, {"gpus": 4})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "resources.gpus" and err["type"] == "invalid_request_error"
    assert err["code"] == "insufficient_capacity"
    assert err["message"] == (
        "No worker serves 4 GPUs per job; sizes served: 1, 2. Ask for one of these in resources.gpus, "
        "or start a worker with --gpus-per-job 4"
    )
    assert team_rows(client.app, team) == (0, 0)  # type: ignore[arg-type]
    assert len(enqueued.calls) == calls


def test_a_size_no_live_worker_runs_is_refused_even_below_the_largest(
    client: TestClient, team: TeamKey, register: Register, settings: Settings
) -> None:
    """A worker consumes only its own size's queue: a 3-GPU job with only larger workers would wait forever."""
    register("gpus-eight@test", 8, f"{settings.default_queue}-x8")
    r = _create(client, team, uploaded_id(client, team), {"gpus": 3})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "resources.gpus"
    assert err["message"].startswith("No worker serves 3 GPUs per job; sizes served: 1, 8. ")
    assert err["message"].endswith("--gpus-per-job 3")
    assert team_rows(client.app, team) == (0, 0)  # type: ignore[arg-type]


def test_no_live_worker_admits_more_gpus_only_where_this_server_runs_cpu_ranks(
    app: FastAPI, client: TestClient, team: TeamKey, settings: Settings, enqueued: Enqueued
) -> None:
    file_id = uploaded_id(client, team)
    # No worker counts as live (other tests' workers may be running): a heartbeat must be under 1 ms old.
    # (set and put back by hand: monkeypatch's undo deletes an attribute of starlette's State)
    none_live = settings.model_copy(update={"worker_live_seconds": 1e-3})
    app.state.settings = none_live
    try:
        r = _create(client, team, file_id, {"gpus": 2})
        one = _create(client, team, file_id, {"gpus": 1})
        # the embedded server: its own worker runs 2 CPU ranks per job, maybe not registered yet
        app.state.settings = none_live.model_copy(update={"cpu_ranks": True, "gpus_per_job": 2})
        ok = _create(client, team, file_id, {"gpus": 2})
        too_big = _create(client, team, file_id, {"gpus": 3})
    finally:
        app.state.settings = settings
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "resources.gpus"
    assert err["message"].startswith("No worker serves 2 GPUs per job (no worker is live); sizes served: 1. ")
    assert one.status_code == 200, one.text  # one GPU: as always
    assert ok.status_code == 200, ok.text
    assert (ok.json()["id"], f"{settings.default_queue}-x2") in enqueued.calls
    # issue 25: the sizes the embedded server serves, not just one GPU
    assert too_big.status_code == 400 and error_of(too_big)["param"] == "resources.gpus"
    assert error_of(too_big)["message"] == (
        "No worker serves 3 GPUs per job (no worker is live); sizes served: 1, 2. Ask for one of these in "
        "resources.gpus, or start a worker with --gpus-per-job 3"
    )


@pytest.mark.parametrize(
    "resources",
    [
        {"gpus": "2"},
        {"gpus": 2.0},
        {"gpus": True},
        {"gpus": 0},
        {"gpus": 65},
        {"gpus": None},
        {"cpus": 2},
        "two",
        [2],
    ],
)
def test_bad_resources_are_a_400_naming_the_field(
    client: TestClient, team: TeamKey, resources: Any, enqueued: Enqueued
) -> None:
    calls = len(enqueued.calls)
    r = _create(client, team, uploaded_id(client, team), resources)
    assert r.status_code == 400, r.text
    err = error_of(r)
    expected = (
        "resources.cpus"
        if isinstance(resources, dict) and "cpus" in resources
        else "resources.gpus"
        if isinstance(resources, dict)
        else "resources"
    )
    assert err["param"] == expected, err
    assert team_rows(client.app, team) == (0, 0)  # type: ignore[arg-type]
    assert len(enqueued.calls) == calls


def test_each_rank_needs_an_example_of_every_step(
    client: TestClient, team: TeamKey, register: Register, settings: Settings
) -> None:
    register("gpus-four@test", 4, f"{settings.default_queue}-x4")
    file_id = uploaded_id(client, team)
    r = _create(client, team, file_id, {"gpus": 2}, batch_size=1)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "hyperparameters.batch_size" and "resources.gpus (2)" in err["message"]
    # where the request gives them: method.supervised.hyperparameters
    r = client.post(
        "/v1/fine_tuning/jobs",
        headers=team.headers,
        json={
            "model": "tiny-llama",
            "training_file": file_id,
            "resources": {"gpus": 4},
            "method": {"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 3}}},
        },
    )
    assert r.status_code == 400 and error_of(r)["param"] == "method.supervised.hyperparameters.batch_size"
    # 'auto' over a 3-example file is 3, fewer than 4 ranks
    small = uploaded_id(client, team, chat_jsonl(3))
    r = _create(client, team, small, {"gpus": 4}, batch_size="auto")
    assert r.status_code == 400 and error_of(r)["param"] == "hyperparameters.batch_size"
    assert "'auto' resolves to 3" in error_of(r)["message"]
    # an explicit batch of 4 over 3 examples: the file is what falls short
    r = _create(client, team, small, {"gpus": 4}, batch_size=4)
    assert r.status_code == 400 and error_of(r)["param"] == "training_file"
    assert team_rows(client.app, team) == (0, 0)  # type: ignore[arg-type]
    # the x4 worker's size with a batch of at least 4: admitted
    assert _create(client, team, file_id, {"gpus": 4}, batch_size=4).status_code == 200


def test_idempotent_replay_sees_the_resources(
    client: TestClient, team: TeamKey, register: Register, settings: Settings
) -> None:
    register("gpus-two-d@test", 2, f"{settings.default_queue}-x2")
    file_id = uploaded_id(client, team)
    headers = {**team.headers, "Idempotency-Key": "gpus-key"}
    body = {
        "model": "tiny-llama",
        "training_file": file_id,
        "hyperparameters": {"batch_size": 4},
        "resources": {"gpus": 2},
    }
    first = client.post("/v1/fine_tuning/jobs", headers=headers, json=body)
    assert first.status_code == 200, first.text
    again = client.post("/v1/fine_tuning/jobs", headers=headers, json=body)
    assert again.headers.get("Idempotent-Replayed") == "true" and again.json()["resources"] == {
        "gpus": 2,
        "nodes": 1,
    }
    other = client.post("/v1/fine_tuning/jobs", headers=headers, json={**body, "resources": {"gpus": 1}})
    assert other.status_code == 409


# --- the registry -------------------------------------------------------------------------------------


def test_live_job_sizes_count_live_workers_only(pg_url: str) -> None:
    with session_scope(pg_url) as s:
        long_ago = utcnow() - timedelta(hours=1)
        # other tests' workers may be live: stale for this transaction only (rolled back at the end)
        s.execute(update(Worker).values(heartbeat_at=long_ago - timedelta(hours=2)))
        assert worker_registry.live_job_sizes(s, live_seconds=60) == []
        worker_registry.register(s, "reg-stale@test", ["q-x8"], {}, gpus_per_job=8, now=long_ago)
        assert worker_registry.live_job_sizes(s, live_seconds=60) == []
        worker_registry.register(s, "reg-one@test", ["q"], {})
        worker_registry.register(s, "reg-two@test", ["q-x2"], {}, gpus_per_job=2)
        assert worker_registry.get(s, "reg-one@test").gpus_per_job == 1  # type: ignore[union-attr]
        assert worker_registry.live_job_sizes(s, live_seconds=60) == [1, 2]
        assert worker_registry.live_job_sizes(s, live_seconds=7200) == [1, 2, 8]
        worker_registry.register(
            s, "reg-two@test", ["q-x4"], {}, gpus_per_job=4
        )  # restarted with another size
        assert worker_registry.live_job_sizes(s, live_seconds=60) == [1, 4]
        with pytest.raises(ValueError, match="gpus_per_job"):
            worker_registry.register(s, "reg-zero@test", ["q"], {}, gpus_per_job=0)
        s.rollback()


# --- migration 0007 -----------------------------------------------------------------------------------


def _migration_round_trip(url: str) -> None:
    migrate.upgrade(url, "0006")
    engine = make_engine(url)
    try:
        with Session(engine) as s:
            team = Team(name="t")
            s.add(team)
            s.flush()
            s.execute(
                text(
                    "INSERT INTO files (id, team_id, filename, purpose, bytes, sha256, storage_path, "
                    "num_examples, status, created_at) VALUES ('file-1', :t, 'f', 'fine-tune', 1, '0', "
                    "'/x', 1, 'processed', '2026-01-01 00:00:00+00')"
                ),
                {"t": team.id},
            )
            s.execute(
                text(
                    "INSERT INTO fine_tuning_jobs (id, team_id, model, training_file_id, status, "
                    "hyperparameters, engine, seed, created_at, queue, cancel_requested, attempts, "
                    "global_step) VALUES ('ftjob-old', :t, 'tiny-llama', 'file-1', 'queued', '{}', '{}', "
                    "0, '2026-01-01 00:00:00+00', 'q', false, 0, 0)"
                ),
                {"t": team.id},
            )
            s.execute(
                text(
                    "INSERT INTO workers (name, queues, capacity, started_at, heartbeat_at) VALUES "
                    "('old@host', '[\"q\"]', '{}', '2026-01-01 00:00:00+00', '2026-01-01 00:00:00+00')"
                )
            )
            s.commit()
        migrate.upgrade(url, "0007")
        if migrate.head() == "0007":  # no drift against store/orm.py (later revisions: test_migrations)
            migrate.check(url)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT gpus_per_job FROM workers")).scalar_one() == 1
            assert conn.execute(text("SELECT resources FROM fine_tuning_jobs")).scalar_one() is None
        with Session(engine) as s:
            worker_registry.register(s, "new@host", ["q-x2"], {}, gpus_per_job=2)
            s.commit()
            assert worker_registry.live_job_sizes(s, live_seconds=60) == [2]
            # plain SQL: the ORM of later revisions maps columns 0007 lacks (0008: not_before)
            s.execute(
                text("UPDATE fine_tuning_jobs SET resources = :r WHERE id = 'ftjob-old'"),
                {"r": '{"gpus": 2}'},
            )
            s.commit()
        engine.dispose()
        migrate.downgrade(url, "0006")
        insp = inspect(engine)
        assert "gpus_per_job" not in {c["name"] for c in insp.get_columns("workers")}
        assert "resources" not in {c["name"] for c in insp.get_columns("fine_tuning_jobs")}
        with engine.connect() as conn:  # the rows stay
            assert conn.execute(text("SELECT count(*) FROM fine_tuning_job_events")).scalar_one() == 0
            assert conn.execute(text("SELECT id FROM fine_tuning_jobs")).scalar_one() == "ftjob-old"
            assert conn.execute(text("SELECT count(*) FROM workers")).scalar_one() == 2
    finally:
        engine.dispose()


@pytest.mark.services
def test_migration_0007_postgresql() -> None:
    url = create_database("zf_api_mig7")
    try:
        _migration_round_trip(url)
    finally:
        drop_database(url)


def test_migration_0007_sqlite(tmp_path: Path) -> None:
    _migration_round_trip(f"sqlite:///{tmp_path / 'zenflow.db'}")


# --- end to end: the embedded server runs a 2-rank job on the CPU --------------------------------------

ROOT = Path(__file__).resolve().parents[2]
#: How long the end-to-end job may take (start, two gloo ranks, a few steps, the final model).
E2E_SECONDS = 600


def _serve(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int, Path]:
    """``zenflow serve`` on embedded defaults (SQLite, in-process worker) with two CPU ranks per job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZENFLOW_")}
    env.update(
        ZENFLOW_DATA_DIR=str(tmp_path / "var"),
        ZENFLOW_CPU_RANKS="true",
        ZENFLOW_GPUS_PER_JOB="2",
        ZENFLOW_HEARTBEAT_INTERVAL_SECONDS="2",
    )
    port = free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "api.cli.main", "serve", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, port, log_path


@pytest.mark.slow
def test_two_rank_job_on_the_embedded_server_succeeds_and_its_model_loads(tmp_path: Path) -> None:
    import httpx

    from api.core.auth import create_key, create_team
    from trainer.samples import TRAIN_FILE

    proc, port, log_path = _serve(tmp_path)

    def tail() -> str:
        return log_path.read_text(errors="replace")[-4000:]

    try:
        base = f"http://127.0.0.1:{port}"
        deadline, ready = time.monotonic() + 120, False
        while time.monotonic() < deadline and proc.poll() is None and not ready:
            with contextlib.suppress(httpx.HTTPError):
                ready = httpx.get(f"{base}/readyz", timeout=2).status_code == 200
            time.sleep(0.5)
        assert ready, tail()
        with session_scope(f"sqlite:///{tmp_path / 'var' / 'zenflow.db'}") as s:  # migrated by serve
            _, key = create_key(s, create_team(s, "e2e-gpus"), "test")
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
            r = http.post(
                "/v1/files",
                data={"purpose": "fine-tune"},
                files={"file": (TRAIN_FILE.name, TRAIN_FILE.read_bytes())},
            )
            assert r.status_code == 200, r.text
            r = http.post(
                "/v1/fine_tuning/jobs",
                json={
                    "model": "tiny-llama",
                    "training_file": r.json()["id"],
                    "seed": 1,
                    "resources": {"gpus": 2},
                    "hyperparameters": {
                        "n_epochs": 1,
                        "batch_size": 8,
                        "max_steps": 4,
                        "checkpoint_every": 2,
                    },
                    "engine": {"mode": "zenflow", "topk_ratio": 0.1, "update_interval": 2},
                },
            )
            assert r.status_code == 200, r.text
            job = r.json()
            assert job["resources"] == {"gpus": 2, "nodes": 1}
            deadline = time.monotonic() + E2E_SECONDS
            while job["status"] not in ("succeeded", "failed", "cancelled") and time.monotonic() < deadline:
                time.sleep(2)
                job = http.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
            events = http.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"limit": 30}).json()["data"]
            assert job["status"] == "succeeded", (job, [e["message"] for e in events], tail())
            assert job["progress"]["step"] == 4 and job["resources"] == {"gpus": 2, "nodes": 1}
            all_events = http.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"limit": 100}).json()
            assert str(tmp_path) not in json.dumps(all_events) and "output_dir" not in job  # no server path
            # it ran as two ranks: the run ledger counts 2 GPUs, the checkpoints hold one engine shard per rank
            with session_scope(f"sqlite:///{tmp_path / 'var' / 'zenflow.db'}") as s:
                gpus = (
                    s.execute(
                        text("SELECT gpus FROM fine_tuning_job_runs WHERE job_id = :j"), {"j": job["id"]}
                    )
                    .scalars()
                    .all()
                )
            assert gpus == [2], gpus
            ckpts = http.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
            assert ckpts and all("path" not in c for c in ckpts)  # the API shows no server path
            with session_scope(f"sqlite:///{tmp_path / 'var' / 'zenflow.db'}") as s:
                ckpt_dir = s.execute(
                    text(
                        "SELECT path FROM fine_tuning_job_checkpoints WHERE fine_tuned_model_checkpoint = :m"
                    ),
                    {"m": ckpts[0]["fine_tuned_model_checkpoint"]},
                ).scalar_one()
            assert sorted(p.name for p in Path(ckpt_dir).glob("engine-rank*.pt")) == [
                "engine-rank00000-of-00002.pt",
                "engine-rank00001-of-00002.pt",
            ]
            # Neither the checkpoint's download nor the model's holds the training state.
            for model in (ckpts[0]["fine_tuned_model_checkpoint"], job["fine_tuned_model"]):
                tar = http.get(f"/v1/models/{model}/content", timeout=120)
                assert tar.status_code == 200, tar.text[:500]
                with tarfile.open(fileobj=io.BytesIO(tar.content)) as archive:
                    names = archive.getnames()
                    assert "model.safetensors" in names and "config.json" in names, names
                    assert not [n for n in names if n.endswith(".pt") or n == "zenflow_checkpoint.json"], (
                        names
                    )
                    if model == job["fine_tuned_model"]:
                        archive.extractall(tmp_path / "model", filter="data")
    finally:
        stop_process_group(proc)

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", local_files_only=True)
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3, 4]]))
    assert torch.isfinite(out.logits).all()


def test_a_job_on_more_nodes_than_live_workers_of_its_size_is_refused_and_writes_nothing(
    client: TestClient, team: TeamKey, register: Register, settings: Settings, enqueued: Enqueued, pg_url: str
) -> None:
    """``resources.nodes`` M needs M live workers of the job's queue and size to form its gang."""
    queue = settings.default_queue
    register("node-one@test", 1, queue)
    register("node-x2@test", 2, f"{queue}-x2")  # another size: no member of a 1-GPU gang
    file_id = uploaded_id(client, team)
    calls = len(enqueued.calls)
    r = _create(client, team, file_id, {"nodes": 2, "gpus": 1})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert (err["param"], err["code"]) == ("resources.nodes", "insufficient_capacity")
    assert err["message"].startswith(
        f"No set of live workers can run 2 nodes x 1 GPUs: queue {queue} has 1 live"
    )
    assert team_rows(client.app, team) == (0, 0)  # type: ignore[arg-type]
    assert len(enqueued.calls) == calls

    r = _create(client, team, file_id, {"nodes": 2, "gpus": 1}, batch_size=1)  # 2 ranks, 1 example a step
    assert r.status_code == 400 and error_of(r)["param"] == "hyperparameters.batch_size", r.text
    assert "resources.nodes x resources.gpus (2)" in error_of(r)["message"]

    register("node-two@test", 1, queue)
    r = _create(client, team, file_id, {"nodes": 2, "gpus": 1})
    assert r.status_code == 200, r.text
    assert r.json()["resources"] == {"gpus": 1, "nodes": 2}
    with session_scope(pg_url) as s:
        row = s.get(FineTuningJob, r.json()["id"])
        assert (
            row is not None
            and row.request.resources.model_dump(exclude_unset=True) == {"nodes": 2, "gpus": 1}
            and row.queue == queue
        )
    assert _create(client, team, file_id, {"nodes": 17}).status_code == 400  # at most 16 nodes

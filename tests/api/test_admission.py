"""Admission by capacity: ``POST /v1/fine_tuning/jobs`` plans the job against the live workers of its
queue (or the default capacity when none is registered) and refuses, writing nothing, a job that fits
none; the job process re-checks against its own worker and fails the job with the same message."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.jobs.admission import candidates
from store import worker_registry
from store.db import session_scope
from store.orm import FineTuningJob, JobEvent
from store.settings import Settings
from tests.api.conftest import TeamKey, error_of, uploaded_id
from trainer.plan.gpus import GiB
from worker.capacity.measure import WorkerCapacity

#: An H100 box with too little host memory for any job (the job process alone is planned at 2 GiB).
SMALL = WorkerCapacity(
    device_type="cuda",
    gpu_name="NVIDIA H100 80GB HBM3",
    gpu_memory_bytes=80 * GiB,
    gpus_on_host=1,
    host_memory_bytes=GiB,
    cores=8,
    cpu_adam_gbps=20.0,
    pcie_gbps=50.0,
)
BIG = SMALL.model_copy(update={"host_memory_bytes": 256 * GiB})
#: Engine settings whose job fits none of the small workers, whatever single setting changes: the
#: refusal's field is then the model (trainer.plan.advice.with_fixes).
ENGINE = {"mode": "zenflow", "accumulate_on": "host"}

Register = Callable[..., None]


@pytest.fixture
def register(pg_url: str, settings: Settings) -> Iterator[Register]:
    """Register workers (on the app's queue unless told otherwise); all removed afterwards."""
    names: list[str] = []

    def add(name: str, capacity: WorkerCapacity, queue: str | None = None) -> None:
        with session_scope(pg_url) as s:
            worker_registry.register(
                s, name, [queue or settings.default_queue], capacity.model_dump(mode="json")
            )
        names.append(name)

    def remove(name: str) -> None:
        with session_scope(pg_url) as s:
            worker_registry.unregister(s, name)

    add.remove = remove  # type: ignore[attr-defined]
    yield add
    for name in names:
        remove(name)


def _create(client: TestClient, team: TeamKey, file_id: str) -> Any:
    return client.post(
        "/v1/fine_tuning/jobs",
        headers=team.headers,
        json={
            "model": "tiny-llama",
            "training_file": file_id,
            "engine": ENGINE,
            "hyperparameters": {"n_epochs": 1, "batch_size": 4},
        },
    )


def _counts(pg_url: str) -> tuple[int, int]:
    with session_scope(pg_url) as s:
        return s.scalar(select(func.count()).select_from(FineTuningJob)) or 0, s.scalar(
            select(func.count()).select_from(JobEvent)
        ) or 0


def test_job_too_big_for_every_worker_is_refused_and_leaves_no_row(
    client: TestClient, team: TeamKey, register: Register, pg_url: str
) -> None:
    register("adm-small-a@test", SMALL)
    register("adm-small-b@test", SMALL.model_copy(update={"host_memory_bytes": 3 * GiB // 2}))
    file_id = uploaded_id(client, team)
    before = _counts(pg_url)
    r = _create(client, team, file_id)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "model" and err["code"] == "insufficient_capacity"
    # the closest worker (most host memory) and the numbers: what the job needs, what the worker has
    assert "any of the 2 live workers of its queue; the closest is worker adm-small-b@test" in err["message"]
    assert "GiB of host memory" in err["message"] and "the machine has 1.5 GiB" in err["message"]
    assert _counts(pg_url) == before
    assert client.get("/v1/fine_tuning/jobs", headers=team.headers).json()["data"] == []


def test_job_that_fits_a_worker_is_accepted(
    client: TestClient, team: TeamKey, register: Register, pg_url: str
) -> None:
    register("adm-small@test", SMALL)
    register("adm-big@test", BIG)
    r = _create(client, team, uploaded_id(client, team))
    assert r.status_code == 200, r.text
    with session_scope(pg_url) as s:
        assert s.get(FineTuningJob, r.json()["id"]) is not None


def test_no_worker_registered_uses_the_default_capacity(
    app: FastAPI, client: TestClient, team: TeamKey, register: Register, settings: Settings
) -> None:
    register("adm-elsewhere@test", SMALL, queue="some-other-queue")  # another queue's worker does not count
    with app.state.sessionmaker() as s:
        ((name, capacity),) = candidates(s, settings.default_queue, settings)
    assert name.startswith("the default worker") and capacity.gpu_name == settings.default_worker_gpu
    file_id = uploaded_id(client, team)
    assert _create(client, team, file_id).status_code == 200  # the default box takes a tiny model
    # (set and put back by hand: monkeypatch's undo deletes an attribute of starlette's State)
    app.state.settings = settings.model_copy(update={"default_worker_host_memory_bytes": GiB})
    try:
        r = _create(client, team, file_id)
    finally:
        app.state.settings = settings
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "model"
    assert f"the default worker (none registered on queue {settings.default_queue})" in err["message"]
    assert "the machine has 1.0 GiB" in err["message"]


def test_worker_recheck_fails_a_job_that_no_longer_fits_with_the_same_message(
    client: TestClient,
    team: TeamKey,
    register: Register,
    settings: Settings,
    pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Accepted while a big worker was live; run by a small one, whose re-check fails it with the
    message the API gives for the same job against that worker."""
    from worker.job.exits import EXIT_DONE
    from worker.job.runner import HOSTNAME_ENV, run_job_process

    file_id = uploaded_id(client, team)
    register("adm-big-gone@test", BIG)
    created = _create(client, team, file_id)
    assert created.status_code == 200, created.text
    register.remove("adm-big-gone@test")  # type: ignore[attr-defined]
    register("adm-recheck@test", SMALL)
    refused = _create(client, team, file_id)
    assert refused.status_code == 400, refused.text

    monkeypatch.setenv(HOSTNAME_ENV, "adm-recheck@test")
    assert run_job_process(created.json()["id"], settings=settings) == EXIT_DONE
    job = client.get(f"/v1/fine_tuning/jobs/{created.json()['id']}", headers=team.headers).json()
    assert job["status"] == "failed"
    assert job["error"] == {
        "code": "insufficient_capacity",
        "message": error_of(refused)["message"],
        "param": "model",
    }

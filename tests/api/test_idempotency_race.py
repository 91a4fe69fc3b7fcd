"""Idempotency under concurrency: every caller with the same Idempotency-Key and body learns the one
job, through a real server (uvicorn on a loopback port) and 20 threads released at once, on PostgreSQL
and on the embedded SQLite."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.core.errors import APIError
from store.orm import FineTuningJob
from store.settings import Settings
from tests.api.conftest import TEST_API_SETTINGS, Enqueued, ServerThread, TeamKey, make_team, uploaded_id

CALLERS = 20
#: The queue event a create writes with the job (its text is the router's).
QUEUED = "Job queued on q"


@pytest.fixture(scope="module", params=["postgresql", "sqlite"])
def race_app(
    request: pytest.FixtureRequest, settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> FastAPI:
    from api.app import create_app

    if request.param == "sqlite":  # the embedded default: same answers, writers serialized by SQLite
        settings = Settings(_env_file=None, data_dir=tmp_path_factory.mktemp("race-sqlite"))  # type: ignore[call-arg]
        return create_app(
            settings, TEST_API_SETTINGS.model_copy(update={"migrate_on_start": True}), enqueue=Enqueued()
        )
    return create_app(settings, TEST_API_SETTINGS, enqueue=Enqueued())


@pytest.fixture(scope="module")
def server(race_app: FastAPI) -> Iterator[ServerThread]:
    with ServerThread(race_app) as s:
        yield s


@pytest.fixture(scope="module")
def race_client(race_app: FastAPI, server: ServerThread) -> Iterator[TestClient]:
    with TestClient(race_app) as c:
        yield c


def _jobs_with_key(app: FastAPI, team_id: str, key: str) -> list[str]:
    with app.state.sessionmaker() as s:
        return list(
            s.scalars(
                select(FineTuningJob.id).where(
                    FineTuningJob.team_id == team_id, FineTuningJob.idempotency_key == key
                )
            )
        )


def _race(server: ServerThread, team: TeamKey, body: dict[str, object], key: str) -> list[httpx.Response]:
    barrier = threading.Barrier(CALLERS, timeout=30)
    results: list[httpx.Response | BaseException] = [RuntimeError("not run")] * CALLERS

    def call(i: int) -> None:
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            try:
                barrier.wait()
                results[i] = c.post(
                    "/v1/fine_tuning/jobs", json=body, headers={**team.headers, "Idempotency-Key": key}
                )
            except BaseException as exc:  # reported by the assertion below
                results[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(CALLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "a caller did not finish"
    assert all(isinstance(r, httpx.Response) for r in results), results
    return [r for r in results if isinstance(r, httpx.Response)]


@pytest.mark.parametrize("round_", range(3))
def test_twenty_concurrent_creates_with_one_key_get_one_job(
    race_app: FastAPI, server: ServerThread, race_client: TestClient, round_: int
) -> None:
    team = make_team(race_app)
    fid = uploaded_id(race_client, team)
    body = {"model": "tiny-llama", "training_file": fid, "hyperparameters": {"n_epochs": 1}}
    key = f"race-{round_}"
    responses = _race(server, team, body, key)

    assert [r.status_code for r in responses] == [200] * CALLERS, [
        r.text for r in responses if r.status_code != 200
    ]
    ids = {r.json()["id"] for r in responses}
    assert len(ids) == 1, ids
    replayed = [r.headers.get("idempotent-replayed") == "true" for r in responses]
    assert replayed.count(False) == 1, "exactly one caller created the job, the others replayed it"
    assert _jobs_with_key(race_app, team.id, key) == list(ids)
    enqueued = race_app.state.enqueue
    assert isinstance(enqueued, Enqueued)
    assert [j for j, _ in enqueued.calls if j in ids] == list(ids), "enqueued exactly once"


def test_insert_loser_replays_the_winner_or_refuses_another_body(
    race_app: FastAPI, race_client: TestClient
) -> None:
    """The race's loser path, deterministically: the winner's row is already committed when the
    loser's insert flushes (the loser's first look found nothing)."""
    from api.routers.jobs import _insert_or_replay

    team = make_team(race_app)
    fid = uploaded_id(race_client, team)

    def job(digest: str) -> FineTuningJob:
        return FineTuningJob(
            team_id=team.id,
            model="tiny-llama",
            training_file_id=fid,
            status="queued",
            idempotency_key="k",
            request_hash=digest,
            queue="q",
        )

    with race_app.state.sessionmaker() as s:
        winner = job("a" * 64)
        assert _insert_or_replay(s, winner, "k", "a" * 64, QUEUED) is None
    with race_app.state.sessionmaker() as s:
        prior = _insert_or_replay(s, job("a" * 64), "k", "a" * 64, QUEUED)
        assert prior is not None and prior.id == winner.id
    with race_app.state.sessionmaker() as s, pytest.raises(APIError) as err:
        _insert_or_replay(s, job("b" * 64), "k", "b" * 64, QUEUED)
    assert err.value.status_code == 409 and err.value.code == "idempotency_key_reused"
    with race_app.state.sessionmaker() as s:
        n = s.scalar(select(func.count()).select_from(FineTuningJob).where(FineTuningJob.team_id == team.id))
    assert n == 1

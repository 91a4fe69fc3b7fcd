"""Fair share between teams, decided by the database: the claim (store.jobs.claim_next, driven directly
against PostgreSQL) takes the job the policy puts first, ``queue_position`` (retrieve and list) shows
that same order before the jobs run, a team at its running quota is held back (race-safe), the broker
keeps one message per queued job, and one real Celery worker on Redis runs two teams' jobs
interleaved (A, B, A, B, A, A)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select

from store import jobs, quotas
from store.orm import FineTuningJob, JobRun, JobStatus, utcnow
from store.settings import Settings
from tests.api.conftest import TEST_API_SETTINGS, Enqueued, TeamKey, make_team, uploaded_id

JOBS = "/v1/fine_tuning/jobs"
HP = {"n_epochs": 1, "batch_size": 4, "max_seq_length": 64, "max_steps": 1}


@pytest.fixture
def fs_settings(settings: Settings) -> Settings:
    """The session's settings on a queue of this test's own (other tests leave jobs waiting on theirs)."""
    return settings.model_copy(update={"default_queue": f"zf-fair-{secrets.token_hex(4)}"})


@pytest.fixture
def fs_app(fs_settings: Settings) -> Iterator[tuple[FastAPI, TestClient, Enqueued]]:
    from api.app import create_app

    enqueued = Enqueued()
    app = create_app(fs_settings, TEST_API_SETTINGS, enqueue=enqueued)
    with TestClient(app) as c:
        yield app, c, enqueued


def _submit(client: TestClient, team: TeamKey, n: int, fid: str) -> list[str]:
    ids = []
    for _ in range(n):
        r = client.post(
            JOBS,
            headers=team.headers,
            json={
                "model": "tiny-llama",
                "training_file": fid,
                "hyperparameters": HP,
                "engine": {"mode": "device"},
            },
        )
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    return ids


def _positions(client: TestClient, teams: dict[str, TeamKey], names: dict[str, str]) -> dict[str, Any]:
    """Each job's queue_position from retrieve (one job) and from the team's list (a page), which must agree."""
    out: dict[str, Any] = {}
    for team in teams.values():
        listed = {j["id"]: j["queue_position"] for j in client.get(JOBS, headers=team.headers).json()["data"]}
        for job_id, pos in listed.items():
            one = client.get(f"{JOBS}/{job_id}", headers=team.headers).json()["queue_position"]
            assert one == pos, (names[job_id], one, pos)
            out[names[job_id]] = pos
    return out


def _claim(settings: Settings, message_job_id: str | None, host: str = "w1@test") -> jobs.NextClaim:
    from store.db import session_scope

    with session_scope(settings.resolved_database_url) as s:
        return jobs.claim_next(s, host, settings, message_job_id=message_job_id, queue=settings.default_queue)


def _finish(settings: Settings, job_id: str) -> None:
    from store.db import session_scope

    with session_scope(settings.resolved_database_url) as s:
        job = jobs.lock_job(s, job_id)
        assert job is not None and job.status == JobStatus.running.value
        jobs.succeed(s, job, "done")


def _two_teams(
    app: FastAPI, client: TestClient, a_jobs: int = 4, b_jobs: int = 2
) -> tuple[dict[str, TeamKey], list[str], dict[str, str]]:
    """Team A submits ``a_jobs`` jobs, then team B ``b_jobs``; their ids in submission order and names
    A1..B2."""
    teams = {"A": make_team(app), "B": make_team(app)}
    fids = {k: uploaded_id(client, t) for k, t in teams.items()}
    a = _submit(client, teams["A"], a_jobs, fids["A"])
    b = _submit(client, teams["B"], b_jobs, fids["B"])
    names = {j: f"A{i + 1}" for i, j in enumerate(a)} | {j: f"B{i + 1}" for i, j in enumerate(b)}
    return teams, a + b, names


def test_claim_order_interleaves_teams_and_queue_position_shows_it(
    fs_app: tuple[FastAPI, TestClient, Enqueued], fs_settings: Settings
) -> None:
    app, client, enqueued = fs_app
    teams, submitted, names = _two_teams(app, client)
    expected = ["A1", "B1", "A2", "B2", "A3", "A4"]
    assert _positions(client, teams, names) == {name: i + 1 for i, name in enumerate(expected)}
    # One worker: the messages come in submission order (FIFO), each claims the policy's first job.
    messages = [job_id for job_id, _ in enqueued.calls]
    assert messages == submitted
    order = []
    for message in messages:
        waiting = _positions(client, teams, names)
        first = next(n for n, p in waiting.items() if p == 1)
        got = _claim(fs_settings, message)
        assert got.outcome is jobs.Claim.claimed and got.job_id is not None
        assert names[got.job_id] == first  # queue_position 1 is what the claim took
        order.append(names[got.job_id])
        _finish(fs_settings, got.job_id)
    assert order == expected
    assert _claim(fs_settings, messages[-1]).outcome is jobs.Claim.idle
    with app.state.sessionmaker() as s:  # every attempt is in the run ledger, ended, with its GPU time
        runs = s.scalars(select(JobRun).where(JobRun.job_id.in_(submitted)).order_by(JobRun.started_at)).all()
    assert [names[r.job_id] for r in runs if r.job_id] == expected
    assert all(r.ended_at is not None and r.gpu_seconds is not None and r.gpu_seconds >= 0 for r in runs)


def test_a_team_with_jobs_running_waits_behind_one_without(
    fs_app: tuple[FastAPI, TestClient, Enqueued], fs_settings: Settings
) -> None:
    """Two workers: while A1 runs, B1 is next, then A2 before B2 (A's turn in round two came first)."""
    app, client, _ = fs_app
    teams, submitted, names = _two_teams(app, client)
    assert _claim(fs_settings, submitted[0], "w1@test").job_id == submitted[0]  # A1 runs on w1
    assert _positions(client, teams, names) == {"A1": None, "B1": 1, "A2": 2, "B2": 3, "A3": 4, "A4": 5}
    got = _claim(fs_settings, submitted[1], "w2@test")
    assert got.job_id is not None and names[got.job_id] == "B1"


def test_running_quota_holds_a_team_back_race_safe(
    fs_app: tuple[FastAPI, TestClient, Enqueued], fs_settings: Settings
) -> None:
    from store.db import session_scope

    app, client, _ = fs_app
    teams, submitted, names = _two_teams(app, client)
    with app.state.sessionmaker() as s:
        quotas.set_limits(s, teams["A"].id, {"max_running_jobs": 1})
        s.commit()
    a1 = _claim(fs_settings, submitted[0], "w1@test")
    assert names[a1.job_id or ""] == "A1"
    # A is at its limit: B's jobs run, then only A's wait and a worker is held.
    assert [
        names[_claim(fs_settings, m, f"w{i}@test").job_id or ""] for i, m in enumerate(submitted[1:3], 2)
    ] == ["B1", "B2"]
    held = _claim(fs_settings, submitted[3], "w4@test")
    assert (
        held.outcome is jobs.Claim.held
        and names[held.job_id or ""] == "A2"
        and held.queue == fs_settings.default_queue
    )
    # Two claims racing for A's one slot once A1 ends: the second sees A's row locked and is held.
    _finish(fs_settings, a1.job_id or "")
    url = fs_settings.resolved_database_url
    with session_scope(url) as first:
        got = jobs.claim_next(first, "w5@test", fs_settings, message_job_id=submitted[4])
        assert got.outcome is jobs.Claim.claimed and names[got.job_id or ""] == "A2"
        with session_scope(url) as second:
            assert (
                jobs.claim_next(second, "w6@test", fs_settings, message_job_id=submitted[5]).outcome
                is jobs.Claim.held
            )
    assert _claim(fs_settings, submitted[5], "w6@test").outcome is jobs.Claim.held
    with app.state.sessionmaker() as s:
        assert quotas.running_jobs(s, teams["A"].id) == 1


def test_messages_still_match_queued_jobs(
    fs_app: tuple[FastAPI, TestClient, Enqueued], fs_settings: Settings
) -> None:
    """Whichever job a message runs, the broker holds one message per queued job, so the dispatcher's
    reconciliation (worker.dispatch) re-sends nothing; a message whose own job is gone or
    finished still runs the next job, and a dead run of this node is taken over first."""
    from worker.dispatch import redispatch_lost_messages

    app, client, enqueued = fs_app
    teams, submitted, _ = _two_teams(app, client)
    broker = [job_id for job_id, _ in enqueued.calls]
    later = utcnow() + timedelta(hours=1)  # every dispatch older than the grace

    def reconcile() -> list[str]:
        # Our queue's broker is the list; other tests' queues in this database are not counted (None).
        mine = fs_settings.default_queue
        return redispatch_lost_messages(
            settings=fs_settings,
            now=later,
            enqueue=lambda j, q: broker.append(j),
            count_messages=lambda qs: {q: len(broker) if q == mine else None for q in qs},
        )

    client.post(f"{JOBS}/{submitted[1]}/cancel", headers=teams["A"].headers)  # A2 cancelled while waiting
    for _ in range(2):
        message = broker.pop(0)
        got = _claim(fs_settings, message)
        assert got.outcome is jobs.Claim.claimed
        with app.state.sessionmaker() as s:
            queued = s.scalars(
                select(FineTuningJob.id).where(
                    FineTuningJob.queue == fs_settings.default_queue, FineTuningJob.status == "queued"
                )
            ).all()
        assert len(broker) >= len(queued) and reconcile() == []
    # A message for a job already finished or unknown still runs a waiting one.
    _finish(fs_settings, got.job_id or "")
    assert _claim(fs_settings, got.job_id).outcome is jobs.Claim.claimed
    assert _claim(fs_settings, "ftjob-gone").outcome is jobs.Claim.claimed
    # This node's own dead run (a restarted worker, a redelivered message) is taken over first.
    with app.state.sessionmaker() as s:
        running = s.scalars(
            select(FineTuningJob).where(
                FineTuningJob.queue == fs_settings.default_queue, FineTuningJob.status == "running"
            )
        ).all()
        mine = next(j for j in running if j.worker_hostname == "w1@test")
    again = _claim(fs_settings, mine.id)
    assert again.outcome is jobs.Claim.claimed and again.job_id == mine.id
    with app.state.sessionmaker() as s:
        open_runs = s.scalars(select(JobRun).where(JobRun.job_id == mine.id, JobRun.ended_at.is_(None))).all()
    assert len(open_runs) == 1  # the lost run was ended, a new one opened


# --- one real worker on Redis --------------------------------------------------------------------------


@pytest.mark.slow
def test_one_worker_runs_two_teams_interleaved(
    fs_app: tuple[FastAPI, TestClient, Enqueued], fs_settings: Settings, redis_url: str, tmp_path: Path
) -> None:
    from tests.worker.test_worker import Workers, wait_for

    app, client, _ = fs_app
    # the claims' full order is test_claim_order_interleaves_teams_and_queue_position_shows_it's; here a
    # real worker shows the first turn: B1, submitted after A2, runs before it
    teams, submitted, names = _two_teams(app, client, a_jobs=2, b_jobs=1)
    expected = ["A1", "B1", "A2"]
    assert _positions(client, teams, names) == {name: i + 1 for i, name in enumerate(expected)}
    workers = Workers(fs_settings, redis_url, fs_settings.default_queue, tmp_path)
    try:
        for job_id in submitted:  # the messages, in submission order, before the worker starts
            workers.enqueue(job_id)
        proc = workers.start("w1")

        def finished() -> bool:
            with app.state.sessionmaker() as s:
                states = s.scalars(select(FineTuningJob.status).where(FineTuningJob.id.in_(submitted))).all()
            assert "failed" not in states, workers.log.read_text()[-4000:]
            return all(st == "succeeded" for st in states)

        wait_for(finished, 600, "the three jobs to succeed", proc, workers.log)
    finally:
        workers.stop()
    with app.state.sessionmaker() as s:
        started = s.execute(
            select(FineTuningJob.id, FineTuningJob.started_at)
            .where(FineTuningJob.id.in_(submitted))
            .order_by(FineTuningJob.started_at)
        ).all()
    assert [names[j] for j, _ in started] == expected

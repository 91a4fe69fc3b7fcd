"""``POST /v1/fine_tuning/jobs/{id}/pause`` and ``/resume``: codes and shapes for every status, another
team's job, the quotas a resume is admitted by, the outbox after a resume (the end to end run, paused and
resumed through the openai SDK to the same weights: tests/e2e/test_pause_flow.py)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from store import quotas
from store.jobs import set_status
from store.orm import FineTuningJob, JobEvent, JobStatus
from tests.api.conftest import Enqueued, TeamKey, error_of, uploaded_id

JOBS = "/v1/fine_tuning/jobs"


@pytest.fixture
def fid(client: TestClient, team: TeamKey) -> str:
    return uploaded_id(client, team)


def _job(client: TestClient, team: TeamKey, fid: str) -> dict[str, Any]:
    r = client.post(JOBS, headers=team.headers, json={"model": "tiny-llama", "training_file": fid})
    assert r.status_code == 200, r.text
    return dict(r.json())


def _post(client: TestClient, team: TeamKey, job_id: str, action: str) -> Any:
    return client.post(f"{JOBS}/{job_id}/{action}", headers=team.headers)


def _row(app: FastAPI, job_id: str) -> FineTuningJob:
    with app.state.sessionmaker() as s:
        job = s.get(FineTuningJob, job_id)
        assert job is not None
        s.expunge(job)
        return job


def _set(app: FastAPI, job_id: str, status: JobStatus, **cols: Any) -> None:
    """Put a job in ``status`` as a worker would have (the test's stand-in for one)."""
    with app.state.sessionmaker() as s:
        job = s.get(FineTuningJob, job_id)
        set_status(s, job, status)
        for k, v in cols.items():
            setattr(job, k, v)
        s.commit()


def _messages(client: TestClient, team: TeamKey, job_id: str) -> list[str]:
    data = client.get(f"{JOBS}/{job_id}/events", params={"limit": 100}, headers=team.headers).json()["data"]
    return [e["message"] for e in reversed(data)]


def test_a_queued_job_pauses_at_once_and_resumes_in_its_queue(
    client: TestClient, app: FastAPI, team: TeamKey, fid: str, enqueued: Enqueued
) -> None:
    job = _job(client, team, fid)
    jid, queue = job["id"], _row(app, job["id"]).queue
    assert job["status"] == "queued" and job["pause_requested"] is False and job["queue_position"]
    sent = len(enqueued.calls)

    r = _post(client, team, jid, "pause")
    paused = r.json()
    assert r.status_code == 200 and paused["status"] == "paused", r.text
    assert paused["queue_position"] is None and paused["pause_requested"] is False
    assert paused["finished_at"] is None and paused["object"] == "fine_tuning.job"
    assert _messages(client, team, jid)[-1] == "Job paused while waiting in its queue"
    # pausing a paused job returns it unchanged
    again = _post(client, team, jid, "pause")
    assert again.status_code == 200 and again.json() == paused
    assert client.get(f"{JOBS}/{jid}", headers=team.headers).json() == paused
    listed = client.get(JOBS, params={"status": "paused"}, headers=team.headers).json()["data"]
    assert [j["id"] for j in listed] == [jid]

    r = _post(client, team, jid, "resume")
    resumed = r.json()
    assert r.status_code == 200 and resumed["status"] == "queued", r.text
    assert resumed["queue_position"] and resumed["created_at"] == job["created_at"]
    assert enqueued.calls[sent:] == [(jid, queue)]  # sent after the commit, then stamped
    assert _row(app, jid).dispatched_at is not None
    assert _messages(client, team, jid)[-1].startswith("Job resumed: queued to restart from step 0")

    r = _post(client, team, jid, "resume")  # not paused (any more)
    assert r.status_code == 409 and r.headers["x-should-retry"] == "false"
    err = error_of(r)
    assert err["code"] == "job_not_paused" and err["param"] == "fine_tuning_job_id"
    assert "is queued" in err["message"]


def test_a_running_job_is_asked_to_pause(client: TestClient, app: FastAPI, team: TeamKey, fid: str) -> None:
    jid = _job(client, team, fid)["id"]
    _set(app, jid, JobStatus.running, global_step=5, total_steps=10, worker_hostname="w@test")
    r = _post(client, team, jid, "pause")
    job = r.json()
    assert r.status_code == 200 and job["status"] == "running" and job["pause_requested"] is True
    assert job["progress"]["step"] == 5
    assert _row(app, jid).pause_requested is True
    assert _messages(client, team, jid)[-1].startswith(
        "Pause requested; the job stops after the current step"
    )
    # a pause again is a no-op; a resume before the runner has paused it is refused
    again = _post(client, team, jid, "pause").json()
    eta = again.pop("estimated_finish"), job.pop("estimated_finish")  # from the clock: may tick over
    assert again == job and abs(eta[0] - eta[1]) <= 2
    r = _post(client, team, jid, "resume")
    assert r.status_code == 409 and error_of(r)["code"] == "job_not_paused"
    assert "running (its pause is pending)" in error_of(r)["message"]
    # the runner stops and pauses it (store.jobs.pause): the flag is gone, the job resumable
    with app.state.sessionmaker() as s:
        from store.jobs import lock_job, pause

        row = lock_job(s, jid)
        assert row is not None
        pause(s, row, "Job paused at step 5")
        s.commit()
    job = client.get(f"{JOBS}/{jid}", headers=team.headers).json()
    assert (job["status"], job["pause_requested"], job["estimated_finish"]) == ("paused", False, None)
    assert _post(client, team, jid, "resume").json()["status"] == "queued"


def test_finished_jobs_and_pending_cancels_cannot_be_paused(
    client: TestClient, app: FastAPI, team: TeamKey, fid: str
) -> None:
    for status in (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled):
        jid = _job(client, team, fid)["id"]
        _set(app, jid, status)
        r = _post(client, team, jid, "pause")
        assert r.status_code == 409, r.text
        err = error_of(r)
        assert err["code"] == "job_not_pausable" and err["param"] == "fine_tuning_job_id"
        assert err["message"] == f"Job {jid} has already {status.value}; it cannot be paused"
        assert error_of(_post(client, team, jid, "resume"))["code"] == "job_not_paused"
        assert _row(app, jid).status == status.value
    jid = _job(client, team, fid)["id"]
    _set(app, jid, JobStatus.running, worker_hostname="w@test")
    assert _post(client, team, jid, "cancel").json()["cancel_requested"] is True
    r = _post(client, team, jid, "pause")
    assert r.status_code == 409 and "is being cancelled" in error_of(r)["message"]
    assert _row(app, jid).pause_requested is False


def test_a_paused_job_is_cancelled_at_once(client: TestClient, team: TeamKey, fid: str) -> None:
    jid = _job(client, team, fid)["id"]
    assert _post(client, team, jid, "pause").json()["status"] == "paused"
    job = _post(client, team, jid, "cancel").json()
    assert job["status"] == "cancelled" and job["finished_at"]
    assert _messages(client, team, jid)[-1] == "Job cancelled while paused"


def test_another_teams_job_is_404(
    client: TestClient, app: FastAPI, team: TeamKey, other_team: TeamKey, fid: str
) -> None:
    jid = _job(client, team, fid)["id"]
    for action in ("pause", "resume"):
        r = _post(client, other_team, jid, action)
        assert r.status_code == 404 and error_of(r)["code"] == "not_found", r.text
        assert error_of(r)["param"] == "fine_tuning_job_id"
        assert _post(client, team, "ftjob-nosuchjob", action).status_code == 404
    assert _row(app, jid).status == "queued"
    assert _post(client, team, jid, "pause").status_code == 200
    assert _post(client, other_team, jid, "resume").status_code == 404
    assert _row(app, jid).status == "paused"


def _set_quotas(app: FastAPI, team: TeamKey, **values: Any) -> None:
    with app.state.sessionmaker() as s:
        quotas.set_limits(s, team.id, values)
        s.commit()


def test_a_resume_is_admitted_by_the_quotas_as_a_create(
    client: TestClient, app: FastAPI, team: TeamKey, fid: str, enqueued: Enqueued
) -> None:
    _set_quotas(app, team, max_queued_jobs=1)
    first = _job(client, team, fid)["id"]
    assert _post(client, team, first, "pause").json()["status"] == "paused"
    second = _job(client, team, fid)["id"]  # the paused job does not count as waiting
    usage = client.get("/v1/quotas", headers=team.headers).json()["usage"]
    assert (usage["queued_jobs"], usage["running_jobs"]) == (1, 0)
    sent = len(enqueued.calls)
    with app.state.sessionmaker() as s:
        events = s.query(JobEvent).filter(JobEvent.job_id == first).count()

    r = _post(client, team, first, "resume")
    assert r.status_code == 429, r.text
    err = error_of(r)
    assert (err["code"], err["param"]) == ("quota_exceeded", "max_queued_jobs")
    assert "1 of 1 jobs already wait" in err["message"]
    assert _row(app, first).status == "paused" and len(enqueued.calls) == sent  # nothing changed or sent
    with app.state.sessionmaker() as s:
        assert s.query(JobEvent).filter(JobEvent.job_id == first).count() == events

    _set_quotas(app, team, max_queued_jobs=None, max_running_jobs=0)
    r = _post(client, team, first, "resume")
    assert r.status_code == 400 and error_of(r)["param"] == "max_running_jobs"
    _set_quotas(app, team, max_running_jobs=None)
    assert _post(client, team, second, "cancel").status_code == 200
    assert _post(client, team, first, "resume").json()["status"] == "queued"


def test_a_resume_with_the_broker_away_is_left_to_the_dispatcher(
    client: TestClient, app: FastAPI, team: TeamKey, fid: str, enqueued: Enqueued
) -> None:
    jid = _job(client, team, fid)["id"]
    assert _post(client, team, jid, "pause").status_code == 200
    enqueued.fail = True
    try:
        r = _post(client, team, jid, "resume")
    finally:
        enqueued.fail = False
    # queued without dispatched_at: worker.dispatch sends it at its next round (tests/worker/test_dispatch.py)
    assert r.status_code == 200 and r.json()["status"] == "queued", r.text
    assert _row(app, jid).dispatched_at is None


def test_openapi_documents_the_endpoints(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for action in ("pause", "resume"):
        op = paths[f"{JOBS}/{{fine_tuning_job_id}}/{action}"]["post"]
        assert {"200", "404", "409"} <= set(op["responses"]), op["responses"]
    assert "429" in paths[f"{JOBS}/{{fine_tuning_job_id}}/resume"]["post"]["responses"]
    schema = client.get("/openapi.json").json()["components"]["schemas"]["FineTuningJobObject"]
    assert "paused" in schema["properties"]["status"]["enum"] and "pause_requested" in schema["properties"]

"""Pause and resume as job state changes (store.jobs: request_pause, pause, resume) against the real PostgreSQL: a
waiting job is paused at once and no claim, dispatch, reaper or quota counts it; a running one is flagged
and paused once its run stops (its run ended, its attempt given back); a pause pending when the run ends
otherwise still pauses it; a resume puts it back where fair share ranked it."""

from __future__ import annotations

import secrets
import signal
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from store import jobs, quotas
from store.db import session_scope
from store.fairshare import fair_order
from store.jobs import request_pause, resume
from store.orm import FineTuningJob, JobRun, JobStatus, utcnow
from store.settings import Settings
from tests.worker.claims import claim_job
from tests.worker.test_worker import get_job, make_job, messages, sums_file


@pytest.fixture
def settings(service_env: dict[str, str]) -> Settings:
    from store.settings import get_settings

    return get_settings()


def _pause(url: str, job_id: str) -> None:
    with session_scope(url) as s:
        job = jobs.lock_job(s, job_id)
        assert job is not None
        request_pause(s, job)


def _resume(url: str, job_id: str) -> str:
    with session_scope(url) as s:
        job = jobs.lock_job(s, job_id)
        assert job is not None
        return resume(s, job)


def _order(url: str, queue: str) -> list[str]:
    ranks = fair_order(queue)
    with session_scope(url) as s:
        return list(s.scalars(select(ranks.c.job_id).order_by(ranks.c.pos)))


def _same_team_job(url: str, like: str) -> str:
    """A queued job of ``like``'s team, file and queue, created now (after it)."""
    with session_scope(url) as s:
        src = s.get(FineTuningJob, like)
        assert src is not None
        job = FineTuningJob(
            team_id=src.team_id,
            model=src.model,
            training_file_id=src.training_file_id,
            status=JobStatus.queued.value,
            request=src.request,
            seed=src.seed,
            queue=src.queue,
        )
        s.add(job)
        s.flush()
        return job.id


def _settle(url: str, *job_ids: str) -> None:
    """No job of this test left waiting or running for the other tests' claims and reapers."""
    with session_scope(url) as s:
        for job_id in job_ids:
            job = jobs.lock_job(s, job_id)
            if job is not None and not JobStatus(job.status).terminal:
                jobs.cancel(s, job, "test over")


def test_a_waiting_job_is_paused_at_once_and_nothing_takes_it(settings: Settings, tmp_path: Path) -> None:
    from worker.dispatch import dispatch_undispatched_jobs
    from worker.reaper import reap_stale_jobs

    url, queue = settings.resolved_database_url, f"q-{secrets.token_hex(4)}"
    job_id = make_job(
        url, sums_file(tmp_path / "d.jsonl"), queue=queue, created_at=utcnow() - timedelta(hours=1)
    )
    try:
        _pause(url, job_id)
        job = get_job(url, job_id)
        assert (job.status, job.pause_requested, job.dispatched_at) == ("paused", False, None)
        assert messages(url, job_id)[-1] == "Job paused while waiting in its queue"
        _pause(url, job_id)  # pausing a paused job changes nothing
        assert messages(url, job_id)[-1] == "Job paused while waiting in its queue"
        assert len(messages(url, job_id)) == 1
        # its queued message claims nothing for it; a claim by hand refuses it
        with session_scope(url) as s:
            got = jobs.claim_next(s, "w@pause-test", settings, message_job_id=job_id, queue=queue)
        assert got.outcome is jobs.Claim.idle
        assert claim_job(job_id, "w@pause-test", settings) is jobs.Claim.paused
        assert _order(url, queue) == []
        # neither the dispatcher (queued jobs without a message) nor the reaper (running ones) sends it
        sent: list[str] = []
        dispatch_undispatched_jobs(settings=settings, enqueue=lambda j, q: sent.append(j))
        reap_stale_jobs(settings=settings, enqueue=lambda j, q: sent.append(j))
        assert job_id not in sent and get_job(url, job_id).status == "paused"
        # the team's quotas count it neither as running nor as waiting
        with session_scope(url) as s:
            usage = quotas.usage_for(s, job.team_id, settings)
        assert (usage.running_jobs, usage.queued_jobs) == (0, 0)
    finally:
        _settle(url, job_id)


def test_a_running_job_is_flagged_then_paused_with_its_run_ended(settings: Settings, tmp_path: Path) -> None:
    url = settings.resolved_database_url
    job_id = make_job(url, sums_file(tmp_path / "d.jsonl"), queue=f"q-{secrets.token_hex(4)}")
    try:
        assert claim_job(job_id, "w1@h", settings) is jobs.Claim.claimed
        _pause(url, job_id)
        _pause(url, job_id)  # once pending, a pause again changes nothing
        job = get_job(url, job_id)
        assert (job.status, job.pause_requested, job.attempts) == ("running", True, 1)
        assert messages(url, job_id)[-1].startswith("Pause requested; the job stops after the current step")
        assert sum(m.startswith("Pause requested") for m in messages(url, job_id)) == 1
        with session_scope(url) as s:
            assert quotas.open_gpus(s, job.team_id) == 1
            job_row = jobs.lock_job(s, job_id)
            assert job_row is not None
            jobs.pause(s, job_row, "Job paused at step 3")  # what the runner writes once it stopped
        job = get_job(url, job_id)
        assert (job.status, job.pause_requested, job.worker_hostname, job.heartbeat_at) == (
            "paused",
            False,
            None,
            None,
        )
        assert job.attempts == 0  # a pause is not a failed attempt
        assert job.finished_at is None and not JobStatus(job.status).terminal
        with session_scope(url) as s:
            runs = s.scalars(select(JobRun).where(JobRun.job_id == job_id)).all()
            assert len(runs) == 1 and runs[0].ended_at is not None  # its GPUs freed
            assert quotas.open_gpus(s, job.team_id) == 0
        assert messages(url, job_id)[-1] == "Job paused at step 3"
    finally:
        _settle(url, job_id)


def test_resume_puts_the_job_back_in_its_fair_share_place(settings: Settings, tmp_path: Path) -> None:
    url, queue = settings.resolved_database_url, f"q-{secrets.token_hex(4)}"
    data = sums_file(tmp_path / "d.jsonl")
    a1 = make_job(url, data, queue=queue)
    a2 = _same_team_job(url, a1)
    b1 = make_job(url, data, queue=queue)  # another team, after A's jobs
    try:
        assert _order(url, queue) == [a1, b1, a2]
        created = get_job(url, a1).created_at
        _pause(url, a1)
        assert _order(url, queue) == [a2, b1]  # without it, A's next job takes its round
        with session_scope(url) as s:
            job = jobs.lock_job(s, a2)
            assert job is not None
            with pytest.raises(ValueError):
                resume(s, job)  # only a paused job resumes
        assert _resume(url, a1) == queue
        job = get_job(url, a1)
        assert (job.status, job.dispatched_at, job.created_at) == ("queued", None, created)
        assert messages(url, a1)[-1] == "Job resumed: queued to restart from step 0 (no checkpoint yet)"
        assert _order(url, queue) == [a1, b1, a2]  # ranked as it was: not a new job
    finally:
        _settle(url, a1, a2, b1)


def test_a_paused_job_is_cancelled_at_once(settings: Settings, tmp_path: Path) -> None:
    url = settings.resolved_database_url
    job_id = make_job(url, sums_file(tmp_path / "d.jsonl"), queue=f"q-{secrets.token_hex(4)}")
    _pause(url, job_id)
    with session_scope(url) as s:
        job = jobs.lock_job(s, job_id)
        assert job is not None
        jobs.request_cancel(s, job)
    job = get_job(url, job_id)
    assert job.status == "cancelled" and job.finished_at is not None
    assert messages(url, job_id)[-1] == "Job cancelled while paused"


def test_a_pending_pause_outlives_the_run_however_it_ends(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner killed, the worker lost, the job re-queued by any path, its dead run taken over: a job
    whose pause was pending ends paused (to resume from its last checkpoint), never queued or running."""
    import worker.task as w
    from worker.reaper import reap_stale_jobs

    sent: list[str] = []
    monkeypatch.setattr(w, "enqueue_job", lambda job_id, queue=None: sent.append(job_id))
    url, data = settings.resolved_database_url, sums_file(tmp_path / "d.jsonl")
    queue = f"q-{secrets.token_hex(4)}"
    old = utcnow() - timedelta(seconds=settings.heartbeat_timeout_seconds + 60)
    running = dict(status="running", attempts=1, pause_requested=True, queue=queue)
    killed = make_job(url, data, worker_hostname="w1@h", heartbeat_at=utcnow(), **running)
    lost = make_job(
        url,
        data,
        worker_hostname="dead@h",
        heartbeat_at=old,
        last_checkpoint_path="/j/checkpoint-000007",
        **running,
    )
    requeued = make_job(url, data, worker_hostname="w1@h", heartbeat_at=utcnow(), **running)
    dead = make_job(url, data, worker_hostname="w2@h", heartbeat_at=utcnow(), **running)
    try:
        assert w.finish_after_exit(killed, -signal.SIGKILL, "w1@h", settings) == "paused"
        assert sent == []  # paused: no message
        assert reap_stale_jobs(settings=settings, enqueue=lambda j, q: sent.append(j)) == []
        assert get_job(url, lost).status == "paused"
        assert "paused as requested, to resume from step 7 when resumed" in messages(url, lost)[-1]
        with session_scope(url) as s:
            job = jobs.lock_job(s, requeued)
            assert job is not None
            jobs.requeue(s, job, "Not run: this job needs 2 GPUs")
        assert claim_job(dead, "w2@h", settings) is jobs.Claim.paused  # its node's dead run, taken over
        for job_id in (killed, lost, requeued, dead):
            job = get_job(url, job_id)
            assert (job.status, job.pause_requested, job.attempts) == ("paused", False, 0), job_id
    finally:
        _settle(url, killed, lost, requeued, dead)

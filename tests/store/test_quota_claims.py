"""The GPU-hour quota at the claim (store.jobs.claim_next) and GPU-seconds per GPU in the run ledger
(store.runs), against the real PostgreSQL (issue 25, item 3)."""

from __future__ import annotations

import secrets
import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update

from store import jobs, quotas
from store.db import session_scope
from store.jobs import add_event
from store.orm import FineTuningJob, JobEvent, JobRun, JobStatus, utcnow
from store.settings import Settings
from tests.worker.claims import claim_job
from tests.worker.test_worker import get_job, make_job, sums_file, wait_for


@pytest.fixture
def settings(service_env: dict[str, str]) -> Settings:
    from store.settings import get_settings

    return get_settings()


def _another_job(url: str, like: str) -> str:
    """A queued job of the same team, file and queue as ``like``, created now."""
    with session_scope(url) as s:
        src = s.get(FineTuningJob, like)
        assert src is not None
        job = FineTuningJob(
            team_id=src.team_id,
            model=src.model,
            training_file_id=src.training_file_id,
            status=JobStatus.queued.value,
            request=src.request,
            resolutions=src.resolutions,
            seed=src.seed,
            queue=src.queue,
        )
        s.add(job)
        s.flush()
        return job.id


def _claim(url: str, settings: Settings, queue: str) -> jobs.NextClaim:
    with session_scope(url) as s:
        return jobs.claim_next(s, "w@quota-test", settings, message_job_id=None, queue=queue)


def _holds(url: str, job_id: str) -> list[str]:
    """The quota notices the job got."""
    with session_scope(url) as s:
        rows = s.execute(select(JobEvent.message, JobEvent.data).where(JobEvent.job_id == job_id)).all()
    return [m for m, d in rows if isinstance(d, dict) and d.get(jobs.QUOTA_HOLD) == "gpu_hours"]


def _settle(url: str, *job_ids: str) -> None:
    """No running or queued job of this test left for other tests' reapers and claims."""
    with session_scope(url) as s:
        for job_id in filter(None, job_ids):
            job = jobs.lock_job(s, job_id)
            if job is not None and not JobStatus(job.status).terminal:
                jobs.cancel(s, job, "test over")


def test_a_team_over_its_gpu_hours_waits_at_the_claim_until_its_use_ages_out(
    settings: Settings, tmp_path: Path
) -> None:
    url, queue = settings.resolved_database_url, f"q-{secrets.token_hex(4)}"
    data = sums_file(tmp_path / "d.jsonl")
    a3 = ""
    a1 = make_job(url, data, queue=queue)
    a2 = _another_job(url, a1)
    b1 = make_job(url, data, queue=queue)  # another team, after A's jobs
    team_a = get_job(url, a1).team_id
    now = utcnow()
    with session_scope(url) as s:  # two GPUs for an hour, two hours ago: 2 GPU-hours of a quota of 1
        s.add(
            JobRun(
                team_id=team_a,
                queue=queue,
                gpus=2,
                started_at=now - timedelta(hours=3),
                ended_at=now - timedelta(hours=2),
                gpu_seconds=7200.0,
            )
        )
        quotas.set_limits(s, team_a, {"gpu_hours": 1})
    try:
        # A's jobs come first by fair share, but A is over its quota: B's job is claimed
        got = _claim(url, settings, queue)
        assert (got.outcome, got.job_id) == (jobs.Claim.claimed, b1)
        # only A's jobs wait now: held (the message goes back for one of them), neither failed
        for _ in range(3):
            got = _claim(url, settings, queue)
            assert (got.outcome, got.job_id) == (jobs.Claim.held, a1)
            with session_scope(url) as s:  # other events between the polls (a re-dispatch's)
                add_event(s, a1, "Broker message lost; re-queued", level="warning", data={"status": "queued"})
        assert get_job(url, a1).status == get_job(url, a2).status == "queued"
        for job_id in (a1, a2):  # told once, however many claims passed it over
            holds = _holds(url, job_id)
            assert len(holds) == 1, holds
            assert holds[0].startswith(
                "Waiting: the team's GPU-hour quota of 1 is reached (2.00 GPU-hours used in the last 30 days)"
            )
            assert "in about 30.0 days" in holds[0] or "in about 29.9 days" in holds[0], holds[0]

        # the run leaves the rolling window: A's first job starts
        with session_scope(url) as s:
            s.execute(
                update(JobRun)
                .where(JobRun.team_id == team_a)
                .values(started_at=now - timedelta(days=32), ended_at=now - timedelta(days=31))
            )
        got = _claim(url, settings, queue)
        assert (got.outcome, got.job_id) == (jobs.Claim.claimed, a1)

        # its running job's GPU-seconds count at the next claim: A holds at a quota it has used up since
        with session_scope(url) as s:
            quotas.set_limits(s, team_a, {"gpu_hours": 0.2 / 3600})

        def reached() -> bool:
            with session_scope(url) as s:
                gpu = quotas.gpu_hours_now(s, team_a, settings)
                return gpu is not None and gpu.reached

        wait_for(reached, 30, "the running job to use 0.2 GPU-seconds")
        a3 = _another_job(url, a1)
        got = _claim(url, settings, queue)
        assert (got.outcome, got.job_id) == (jobs.Claim.held, a2)
        assert len(_holds(url, a2)) == 1  # still the same wait: no second notice
        (hold,) = _holds(url, a3)
        assert "once the team's running jobs have stopped" in hold, hold  # its running job alone is over
        # a job that ran and waits again is told again
        with session_scope(url) as s:
            jobs.requeue(s, jobs.lock_job(s, a1), "Worker lost")  # type: ignore[arg-type]
        assert _claim(url, settings, queue).outcome is jobs.Claim.held
        assert len(_holds(url, a1)) == 2 and len(_holds(url, a2)) == 1
    finally:
        _settle(url, a1, a2, a3, b1)


def test_a_multi_gpu_job_counts_its_gpu_seconds_per_gpu(settings: Settings, tmp_path: Path) -> None:
    """Claimed by hand (no size given) or from the one-GPU queue, a 2-GPU job's run holds 2 GPUs: the
    quota sees 2 GPU-seconds per second while it runs and records 2x its run time when it ends."""
    url, queue = settings.resolved_database_url, f"q-{secrets.token_hex(4)}"
    data = sums_file(tmp_path / "d.jsonl")
    job_id = make_job(url, data, queue=queue, resources={"gpus": 2})
    team = get_job(url, job_id).team_id
    with session_scope(url) as s:
        quotas.set_limits(s, team, {"gpu_hours": 1})
    try:
        before = time.monotonic()
        assert claim_job(job_id, "w@h", settings) == "claimed"
        after = time.monotonic()
        time.sleep(0.5)
        t0 = time.monotonic()
        with session_scope(url) as s:
            gpu = quotas.gpu_hours_now(s, team, settings)
            assert s.scalars(select(JobRun.gpus).where(JobRun.job_id == job_id)).all() == [2]
        t1 = time.monotonic()
        assert gpu is not None and gpu.running_gpus == 2
        slack = 0.05  # utcnow against the monotonic clock
        assert 2 * (t0 - after) - slack <= gpu.used_seconds <= 2 * (t1 - before) + slack, gpu
        assert gpu.seconds_to_limit == pytest.approx((3600 - gpu.used_seconds) / 2)
        with session_scope(url) as s:
            jobs.cancel(s, jobs.lock_job(s, job_id), "test over")  # type: ignore[arg-type]
            run = s.scalars(select(JobRun).where(JobRun.job_id == job_id)).one()
            assert run.ended_at is not None and run.gpu_seconds is not None
            wall = (run.ended_at - run.started_at).total_seconds()
            assert run.gpu_seconds == pytest.approx(2 * wall)

        # from the queue's message: the worker's claim counts the job's own size too
        other = make_job(url, data, queue=queue, resources={"gpus": 2})
        got = _claim(url, settings, queue)
        assert (got.outcome, got.job_id) == (jobs.Claim.claimed, other)
        with session_scope(url) as s:
            assert s.scalars(select(JobRun.gpus).where(JobRun.job_id == other)).all() == [2]
        _settle(url, other)
    finally:
        _settle(url, job_id)

"""The run ledger: one :class:`~store.orm.JobRun` per attempt of a job on a worker.

A run is opened by the claim (:func:`store.jobs.claim`) and ended when the job leaves ``running``
(:func:`store.jobs.set_status`, whatever the transition). GPU time is ``gpus`` x run time, ``gpus``
being the ranks the job asks for (its ``world_size``, the request's nodes x gpus: a job on 4 GPUs counts
4 GPU-seconds per second, wherever it is claimed); a run still open counts up to now, so the GPU-hours
quota sees a long job while it runs (the claim and the job's own monitor check it, store.quotas). The
last run's start per team and queue is what fair share orders teams by (:mod:`store.fairshare`).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from store.orm import FineTuningJob, JobRun, as_utc, utcnow


def open_run(
    session: Session, job: FineTuningJob, hostname: str, *, gpus: int, now: datetime | None = None
) -> JobRun:
    """Start a run of ``job`` on ``hostname`` (the caller has just claimed it)."""
    run = JobRun(
        job_id=job.id,
        team_id=job.team_id,
        queue=job.queue,
        worker_hostname=hostname,
        gpus=gpus,
        started_at=now or utcnow(),
    )
    session.add(run)
    return run


def end_runs(session: Session, job_id: str, *, now: datetime | None = None) -> None:
    """End the job's open runs (normally one), recording their GPU-seconds."""
    now = now or utcnow()
    for run in session.scalars(select(JobRun).where(JobRun.job_id == job_id, JobRun.ended_at.is_(None))):
        started = as_utc(run.started_at) or now
        run.ended_at = max(now, started)
        run.gpu_seconds = run.gpus * (run.ended_at - started).total_seconds()


def _seconds_inside(run: JobRun, since: datetime, now: datetime) -> float:
    start = max(as_utc(run.started_at) or now, since)
    end = min(as_utc(run.ended_at) or now, now)
    return run.gpus * max(0.0, (end - start).total_seconds())


def gpu_seconds(session: Session, team_id: str, since: datetime, *, now: datetime | None = None) -> float:
    """GPU-seconds the team used from ``since`` to ``now``: ended runs inside the window by their
    recorded figure (one SUM), the few that straddle its start or are still open by their part in it."""
    now = now or utcnow()
    inside = session.scalar(
        select(func.coalesce(func.sum(JobRun.gpu_seconds), 0.0)).where(
            JobRun.team_id == team_id, JobRun.started_at >= since, JobRun.ended_at.is_not(None)
        )
    )
    partial = session.scalars(
        select(JobRun).where(
            JobRun.team_id == team_id,
            or_(JobRun.ended_at.is_(None), and_(JobRun.started_at < since, JobRun.ended_at > since)),
        )
    )
    return float(inside or 0.0) + sum(_seconds_inside(r, since, now) for r in partial)


def open_gpus(session: Session, team_id: str) -> int:
    """GPUs the team's open runs hold: GPU-seconds its usage grows by per second now."""
    return int(
        session.scalar(
            select(func.coalesce(func.sum(JobRun.gpus), 0)).where(
                JobRun.team_id == team_id, JobRun.ended_at.is_(None)
            )
        )
        or 0
    )


def seconds_until_below(
    session: Session, team_id: str, limit_seconds: float, period: timedelta, *, now: datetime | None = None
) -> float | None:
    """How long until the team's GPU-seconds in the rolling ``period`` fall below ``limit_seconds``
    as its ended runs age out (runs still open only add to it: None when they alone reach the limit)."""
    now = now or utcnow()
    since = now - period
    runs = list(
        session.scalars(
            select(JobRun).where(
                JobRun.team_id == team_id, or_(JobRun.ended_at.is_(None), JobRun.ended_at > since)
            )
        )
    )
    used = sum(_seconds_inside(r, since, now) for r in runs)
    if sum(_seconds_inside(r, since, now) for r in runs if r.ended_at is None) >= limit_seconds:
        return None
    ended = sorted((r for r in runs if r.ended_at is not None), key=lambda r: as_utc(r.ended_at) or now)
    for r in ended:  # oldest end first: a run has left the window entirely once period has passed its end
        used -= _seconds_inside(r, since, now)
        if used < limit_seconds:
            return max(1.0, ((as_utc(r.ended_at) or now) + period - now).total_seconds())
    return None

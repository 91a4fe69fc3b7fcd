"""Job-state writes shared by the API (create, cancel) and the workers (run, events, checkpoints)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from store.models import FineTuningJob, JobEvent, JobStatus, utcnow


def add_event(
    session: Session,
    job_id: str,
    message: str,
    *,
    level: str = "info",
    type: str = "message",
    data: dict[str, Any] | None = None,
) -> JobEvent:
    ev = JobEvent(job_id=job_id, message=message, level=level, type=type, data=data)
    session.add(ev)
    return ev


def set_status(
    session: Session,
    job: FineTuningJob,
    status: JobStatus,
    *,
    message: str | None = None,
    error: dict[str, Any] | None = None,
) -> None:
    """Move a job to ``status`` and record an event; terminal states stamp finished_at, queued clears
    dispatched_at (the new wait needs a message)."""
    job.status = status.value
    if status is JobStatus.queued:
        job.dispatched_at = None  # a new wait in the queue: its message is still to be sent
    if status is JobStatus.running and job.started_at is None:
        job.started_at = utcnow()
    if status.terminal:
        job.finished_at = utcnow()
    if error is not None:
        job.error = error
    level = "error" if status is JobStatus.failed else "info"
    add_event(session, job.id, message or f"Job {status.value}", level=level, data={"status": status.value})


def lock_job(session: Session, job_id: str) -> FineTuningJob | None:
    """Load a job row for update (row lock on PostgreSQL; SQLite serializes writers anyway)."""
    return session.execute(
        select(FineTuningJob).where(FineTuningJob.id == job_id).with_for_update()
    ).scalar_one_or_none()


def mark_dispatched(session: Session, job_id: str) -> bool:
    """Record that the broker accepted the job's message (only while the job is still queued)."""
    res = session.execute(
        update(FineTuningJob)
        .where(FineTuningJob.id == job_id, FineTuningJob.status == JobStatus.queued.value)
        .values(dispatched_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    return bool(res.rowcount)  # type: ignore[attr-defined]

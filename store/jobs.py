"""Job-state writes shared by the API (create, cancel) and the workers (run, events, checkpoints)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
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
    """Move a job to ``status`` and record an event; terminal states stamp finished_at."""
    job.status = status.value
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

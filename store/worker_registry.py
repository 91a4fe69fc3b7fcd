"""The worker registry: each worker process's measured capacity and heartbeat (:class:`~store.orm.Worker`).

A worker registers at start with the queues it consumes, the capacity it measured
(``worker.capacity.measure``) and the size of the jobs it runs (``gpus_per_job``), refreshes its
heartbeat every ``heartbeat_interval_seconds`` and unregisters on a clean stop. It is *live* while its
heartbeat is at most ``worker_live_seconds`` old; admission (``api.jobs.admission``) plans a job against the
live workers of its queue. A worker that died simply stops being live. The capacity is an opaque JSON
object here: store/ knows nothing of its fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from store.orm import Worker, utcnow


def register(
    session: Session,
    name: str,
    queues: Sequence[str],
    capacity: dict[str, Any],
    *,
    gpus_per_job: int = 1,
    now: datetime | None = None,
) -> Worker:
    """Record worker ``name`` (a restarted worker replaces its old row) with a fresh heartbeat;
    ``gpus_per_job``: the ranks of each job it runs."""
    if gpus_per_job < 1:
        raise ValueError(f"gpus_per_job must be at least 1, not {gpus_per_job}")
    now = now or utcnow()
    row = session.get(Worker, name, with_for_update=True)
    if row is None:
        row = Worker(name=name)
        session.add(row)
    row.queues = list(dict.fromkeys(queues))
    row.capacity = dict(capacity)
    row.gpus_per_job = gpus_per_job
    row.started_at = now
    row.heartbeat_at = now
    session.flush()
    return row


def heartbeat(session: Session, name: str, *, now: datetime | None = None) -> bool:
    """Refresh the worker's heartbeat; False when it has no row (removed meanwhile: register again)."""
    result = session.execute(update(Worker).where(Worker.name == name).values(heartbeat_at=now or utcnow()))
    return bool(getattr(result, "rowcount", 0))


def unregister(session: Session, name: str) -> None:
    """Remove the worker's row (a clean stop): it no longer counts for admission."""
    session.execute(delete(Worker).where(Worker.name == name))


def get(session: Session, name: str) -> Worker | None:
    return session.get(Worker, name)


def _live(live_seconds: float, now: datetime | None) -> Any:
    """The condition a live worker meets: a heartbeat at most ``live_seconds`` old."""
    return Worker.heartbeat_at >= (now or utcnow()) - timedelta(seconds=live_seconds)


def live_workers(
    session: Session, queue: str, *, live_seconds: float, now: datetime | None = None
) -> list[Worker]:
    """The workers consuming ``queue`` whose heartbeat is at most ``live_seconds`` old, by name."""
    rows = session.scalars(select(Worker).where(_live(live_seconds, now)).order_by(Worker.name))
    # The queue filter in Python: JSON containment differs between PostgreSQL and SQLite, and a
    # service has a few workers, not thousands.
    return [w for w in rows if queue in (w.queues or [])]


def live_workers_by_queue(
    session: Session, *, live_seconds: float, now: datetime | None = None
) -> dict[str, int]:
    """How many live workers consume each queue (queues with none left out)."""
    counts: dict[str, int] = {}
    for queues in session.scalars(select(Worker.queues).where(_live(live_seconds, now))):
        for q in queues or []:
            counts[q] = counts.get(q, 0) + 1
    return counts


def live_job_sizes(session: Session, *, live_seconds: float, now: datetime | None = None) -> list[int]:
    """The job sizes (ranks per job) live workers run, ascending; empty when no worker is live."""
    rows = session.scalars(select(Worker.gpus_per_job).where(_live(live_seconds, now)).distinct())
    return sorted(int(n) for n in rows)

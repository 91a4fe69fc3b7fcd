"""Per-team quotas: concurrent running jobs, waiting jobs, GPU-hours per rolling period, stored bytes.

A team's limits are its ``team_quotas`` row, each NULL column taking the settings' default
(``default_max_running_jobs``, ``default_max_queued_jobs``, ``default_gpu_hours``,
``default_storage_bytes``; None = unlimited). Where each is enforced:

- ``max_queued_jobs``: at create (:func:`admit_job`): a team with that many jobs waiting is refused
  (429: retry once some have started);
- ``gpu_hours``: at create: a team that used that many GPU-hours in the last ``quota_period_days``
  is refused (429, with the time until enough of its usage ages out of the window when that is
  known); 0 is a hard refusal (400);
- ``storage_bytes``: at create: a team storing that much (store.usage) is refused (400: it lasts
  until files or jobs are deleted);
- ``max_running_jobs``: when a worker claims (store.jobs.claim_next): a team running that many jobs
  is skipped and its jobs wait; 0 refuses creates (400), since such a job could never start.

Creates are counted under the team's row lock (:func:`lock_team`, held to the commit), so two creates
racing for a team's last slot are decided one after the other.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from store.fairshare import WAITING
from store.orm import FineTuningJob, JobStatus, Team, TeamQuota, utcnow
from store.runs import gpu_seconds, seconds_until_below
from store.settings import Settings
from store.usage import team_storage_bytes

#: The quotas, in the order they are shown.
QUOTAS = ("max_running_jobs", "max_queued_jobs", "gpu_hours", "storage_bytes")


@dataclass(frozen=True)
class Limits:
    """A team's effective limits (None = unlimited) and which of them are its own (not the default)."""

    max_running_jobs: int | None
    max_queued_jobs: int | None
    gpu_hours: float | None
    storage_bytes: int | None
    own: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Usage:
    """What a team uses now: jobs running and waiting, GPU-hours in the period, stored bytes."""

    running_jobs: int
    queued_jobs: int
    gpu_hours: float
    storage_bytes: int


class QuotaExceeded(Exception):
    """A create the team's quota refuses: 429 for limits that free up by themselves, 400 for hard ones."""

    def __init__(
        self, quota: str, message: str, *, status_code: int = 429, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.quota, self.message, self.status_code = quota, message, status_code
        self.retry_after = retry_after


def period(settings: Settings) -> timedelta:
    return timedelta(days=settings.quota_period_days)


def limits_for(session: Session, team_id: str, settings: Settings) -> Limits:
    row = session.get(TeamQuota, team_id)
    values: dict[str, Any] = {}
    own = set()
    for name in QUOTAS:
        value = getattr(row, name) if row is not None else None
        if value is None:
            value = getattr(settings, f"default_{name}")
        else:
            own.add(name)
        values[name] = value
    return Limits(**values, own=frozenset(own))


def _count(session: Session, team_id: str, statuses: tuple[str, ...]) -> int:
    return int(
        session.scalar(
            select(func.count())
            .select_from(FineTuningJob)
            .where(FineTuningJob.team_id == team_id, FineTuningJob.status.in_(statuses))
        )
        or 0
    )


def running_jobs(session: Session, team_id: str) -> int:
    return _count(session, team_id, (JobStatus.running.value,))


def storage_bytes(session: Session, team_id: str) -> int:
    return team_storage_bytes(session, team_id)


def usage_for(session: Session, team_id: str, settings: Settings, *, now: datetime | None = None) -> Usage:
    now = now or utcnow()
    return Usage(
        running_jobs=running_jobs(session, team_id),
        queued_jobs=_count(session, team_id, WAITING),
        gpu_hours=gpu_seconds(session, team_id, now - period(settings), now=now) / 3600.0,
        storage_bytes=storage_bytes(session, team_id),
    )


def lock_team(session: Session, team_id: str) -> None:
    """Take the team's row lock until the transaction ends (serializes its creates and quota claims).

    PostgreSQL: ``FOR NO KEY UPDATE`` (rows referring to the team, e.g. uploads, are not blocked);
    SQLite: a no-op UPDATE, which takes the database's write lock (its readers are not blocked).
    """
    if session.get_bind().dialect.name == "sqlite":
        session.execute(update(Team).where(Team.id == team_id).values(name=Team.name))
    else:
        session.execute(select(Team.id).where(Team.id == team_id).with_for_update(key_share=True))


def try_lock_team(session: Session, team_id: str) -> bool:
    """:func:`lock_team` without waiting: False when another transaction holds the team's row."""
    if session.get_bind().dialect.name == "sqlite":
        lock_team(session, team_id)  # one writer at a time anyway
        return True
    got = session.execute(
        select(Team.id).where(Team.id == team_id).with_for_update(key_share=True, skip_locked=True)
    ).scalar_one_or_none()
    return got is not None


def admit_job(session: Session, team_id: str, settings: Settings, *, now: datetime | None = None) -> None:
    """Raise :class:`QuotaExceeded` when the team may not add a job now. Call under :func:`lock_team`."""
    now = now or utcnow()
    limits = limits_for(session, team_id, settings)
    if limits.max_running_jobs == 0:
        raise QuotaExceeded(
            "max_running_jobs",
            "Quota max_running_jobs is 0 for this team: no job of it can run",
            status_code=400,
        )
    if limits.max_queued_jobs is not None:
        queued = _count(session, team_id, WAITING)
        if queued >= limits.max_queued_jobs:
            raise QuotaExceeded(
                "max_queued_jobs",
                (
                    f"Quota max_queued_jobs exceeded: {queued} of {limits.max_queued_jobs} jobs already wait; "
                    "retry once some have started or cancel one"
                ),
            )
    if limits.gpu_hours is not None:
        days = f"{settings.quota_period_days:g} days"
        if limits.gpu_hours == 0:
            raise QuotaExceeded(
                "gpu_hours", f"Quota gpu_hours is 0 per {days} for this team", status_code=400
            )
        limit_s = limits.gpu_hours * 3600.0
        used = gpu_seconds(session, team_id, now - period(settings), now=now)
        if used >= limit_s:
            retry = seconds_until_below(session, team_id, limit_s, period(settings), now=now)
            raise QuotaExceeded(
                "gpu_hours",
                (
                    f"Quota gpu_hours exceeded: {used / 3600:.2f} of {limits.gpu_hours:g} GPU-hours used in the last "
                    f"{days}"
                ),
                retry_after=retry,
            )
    if limits.storage_bytes is not None:
        stored = storage_bytes(session, team_id)
        if stored >= limits.storage_bytes:
            raise QuotaExceeded(
                "storage_bytes",
                (
                    f"Quota storage_bytes exceeded: {stored:,} of {limits.storage_bytes:,} bytes stored; delete files "
                    "or fine-tuned models to make room"
                ),
                status_code=400,
            )


def set_limits(session: Session, team_id: str, values: dict[str, int | float | None]) -> TeamQuota:
    """Set the given quotas of a team (a None value goes back to the settings' default); others keep theirs."""
    unknown = set(values) - set(QUOTAS)
    if unknown:
        raise ValueError(f"unknown quota(s): {', '.join(sorted(unknown))}")
    for name, value in values.items():
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0")
    row = session.get(TeamQuota, team_id)
    if row is None:
        row = TeamQuota(team_id=team_id)
        session.add(row)
    for name, value in values.items():
        setattr(row, name, value)
    row.updated_at = utcnow()
    return row


def as_dict(obj: Limits | Usage) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj) if f.name != "own"}

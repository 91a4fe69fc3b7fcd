"""Per-team quotas: concurrent running jobs, waiting jobs, GPU-hours per rolling period, stored bytes.

A team's limits are its ``team_quotas`` row, each NULL column taking the settings' default
(``default_max_running_jobs``, ``default_max_queued_jobs``, ``default_gpu_hours``,
``default_storage_bytes``; None = unlimited). Where each is enforced:

- ``max_queued_jobs``: at create (:func:`admit_job`): a team with that many jobs waiting is refused
  (429: retry once some have started);
- ``gpu_hours`` (GPU-seconds of every run in the last ``quota_period_days``, a run counting ``gpus`` x
  its wall time, an open one up to now: store.runs), at three points:

  - at create: a team that used that many is refused (429, with the time until enough of its usage
    ages out of the window when that is known); 0 is a hard refusal (400);
  - when a worker claims (store.jobs.claim_next): a team at or over it (its running jobs counted so
    far) is skipped like one at its ``max_running_jobs``. Its jobs stay ``queued`` (never failed:
    usage leaves the rolling window by itself) and start once it is below the limit again (usage
    aged out, the quota raised); each such job gets one warning event saying so per wait (not one per
    poll: none for a job told so since it last ran; :func:`gpu_hold_message`);
  - while a job runs (worker.job.quota_watch, at each heartbeat of the job's monitor, and at the
    moment its team's running jobs are projected to reach the limit): at the limit the job stops
    like a cancel (at its next step, checkpointing there) and fails with error code
    ``quota_exceeded``, ``param`` ``gpu_hours``, its message and event naming the limit, the use,
    the step and the checkpoint kept;

- ``storage_bytes`` (store.usage: uploads, result files, job outputs): at create, a team storing that
  much is refused (400: it lasts until files or jobs are deleted); at upload (api.routers.files,
  :func:`storage_room`), a file that would take the team past it is refused (400, nothing kept: the
  stream is cut at the bytes left, and the size re-checked under the team's row lock before the row
  is written); at each checkpoint of a running job (worker.job.quota_watch), one that takes the team
  past it is removed and the job stops and fails like the GPU-hour case (``param`` ``storage_bytes``),
  its previous checkpoint kept;
- ``max_running_jobs``: when a worker claims (store.jobs.claim_next): a team running that many jobs
  is skipped and its jobs wait; 0 refuses creates (400), since such a job could never start.

Creates are counted under the team's row lock (:func:`lock_team`, held to the commit), so two creates
racing for a team's last slot are decided one after the other. Claims and running jobs do not take it
for the GPU-hour check: two workers claiming for a team just under its limit may both start a job,
and each job's monitor stops it at the limit.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from store.fairshare import WAITING
from store.orm import FineTuningJob, JobStatus, Team, TeamQuota, utcnow
from store.runs import gpu_seconds, open_gpus, seconds_until_below
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


@dataclass(frozen=True)
class GpuHours:
    """A team's GPU-hour quota at one moment, in GPU-seconds."""

    limit_seconds: float
    #: Used in the rolling period up to now, the team's running jobs counted so far.
    used_seconds: float
    #: GPUs the team's running jobs hold: its use grows by that many GPU-seconds per second.
    running_gpus: int

    @property
    def reached(self) -> bool:
        return self.used_seconds >= self.limit_seconds

    @property
    def seconds_to_limit(self) -> float:
        """Wall seconds until the running jobs reach the limit at their current rate (0: reached;
        inf: none runs), ignoring usage that ages out meanwhile (which only puts it later)."""
        if self.reached:
            return 0.0
        if self.running_gpus <= 0:
            return float("inf")
        return (self.limit_seconds - self.used_seconds) / self.running_gpus


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


def gpu_hours_now(
    session: Session,
    team_id: str,
    settings: Settings,
    *,
    limits: Limits | None = None,
    now: datetime | None = None,
) -> GpuHours | None:
    """The team's GPU-hour quota now (None: unlimited)."""
    limit = (limits or limits_for(session, team_id, settings)).gpu_hours
    if limit is None:
        return None
    now = now or utcnow()
    used = gpu_seconds(session, team_id, now - period(settings), now=now)
    return GpuHours(limit * 3600.0, used, open_gpus(session, team_id))


def format_gpu_hours(hours: float) -> str:
    """GPU-hours for a message: two decimals from 1 up, three significant digits below (0.00213)."""
    if hours >= 100:
        return f"{hours:,.1f}"
    return f"{hours:.2f}" if hours >= 1 else f"{hours:.3g}"


def format_wait(seconds: float) -> str:
    """A wait for a message, in its largest sensible unit."""
    for unit, size in (("days", 86400.0), ("hours", 3600.0), ("minutes", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:.1f} {unit}"
    return f"{max(1.0, seconds):.0f} seconds"


def gpu_hold_message(session: Session, team_id: str, gpu: GpuHours, settings: Settings) -> str:
    """What a job held back at the claim by its team's GPU-hour quota is told (once per wait)."""
    retry = seconds_until_below(session, team_id, gpu.limit_seconds, period(settings))
    when = (
        f"in about {format_wait(retry)}" if retry is not None else "once the team's running jobs have stopped"
    )
    return (
        f"Waiting: the team's GPU-hour quota of {gpu.limit_seconds / 3600:g} is reached "
        f"({format_gpu_hours(gpu.used_seconds / 3600)} GPU-hours used in the last "
        f"{settings.quota_period_days:g} days). The job stays queued and starts when enough of that use "
        f"has left the window ({when}) or the quota is raised; cancel it to stop waiting"
    )


def storage_room(session: Session, team_id: str, settings: Settings) -> tuple[int, int] | None:
    """The team's storage quota and what it stores now, ``(limit, stored)`` in bytes (None: unlimited)."""
    limit = limits_for(session, team_id, settings).storage_bytes
    if limit is None:
        return None
    return limit, storage_bytes(session, team_id)


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

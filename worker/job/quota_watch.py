"""A running job's GPU-hour and storage quotas, watched from inside its job process (store.quotas).

**GPU-hours.** The job's monitor (:mod:`worker.job.monitor`) calls :meth:`QuotaWatch.check_gpu_hours` at
each heartbeat: the team's use in the rolling window (store.runs: each run's ``gpus`` x wall time, this
job's run and the team's other running jobs counted up to now) against its limit. Below the limit it
projects when the team's running jobs reach it at their rate, and the monitor checks again at that
moment (its poll, at most a second late) rather than a heartbeat later (:meth:`QuotaWatch.due`).

**Storage.** :meth:`QuotaWatch.guard` wraps the reporter: at each checkpoint the team's stored bytes
(store.usage: the new checkpoint is on disk by then) are held to its limit. A checkpoint that takes
the team past it is removed before its row is written, so the previous checkpoint is the job's last.

**The stop.** At either limit :attr:`QuotaWatch.stop` is set and the job's ``should_stop`` is true: the
loop stops at its next step the way a user's cancel does, checkpointing there if it has not just done so
(that checkpoint is held to the storage quota too). A removed checkpoint that was the run's last one
(no next step to stop at) raises :class:`QuotaReached` instead. The runner then fails the job with
:meth:`QuotaWatch.end_state`: error ``{"code": "quota_exceeded", "param": "gpu_hours" | "storage_bytes",
"message": ...}``, the message (and the job's one error event) naming the limit, the use, the step the job
stopped at and the checkpoint kept (its ``ft:...:ckpt-step-N`` id, from which a new job may start).

Why ``failed``: OpenAI's job statuses are validating_files, queued, running, succeeded, failed and
cancelled; ``cancelled`` tells a client that someone asked for the stop, and the job did not succeed.
``failed`` with an error object is how a client learns why a job ended without its model, and
``quota_exceeded`` is the code a create over a quota gets too, ``param`` naming the quota alike.

Quota checks never stop a job for a database error: a check that cannot read the database is logged
and skipped (the monitor's heartbeat handles outages).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from store import jobs, quotas
from store.db import session_scope
from store.orm import FineTuningJob, JobCheckpoint
from store.settings import Settings
from trainer.events import CheckpointSaved, Event, LogEvent, RunStarted
from worker.errors import is_db_unavailable, public_message

log = logging.getLogger("zenflow.job_runner")

#: The code of a job stopped by its team's quota (the same as a create's refusal).
QUOTA_CODE = "quota_exceeded"


@dataclass(frozen=True)
class Reached:
    """The quota that stopped the job and the figures it was stopped at."""

    #: ``gpu_hours`` or ``storage_bytes``.
    quota: str
    #: GPU-seconds or bytes.
    limit: float
    used: float
    #: storage: the step of the checkpoint removed.
    step: int | None = None


class QuotaReached(Exception):
    """Raised from the event callback when the run's last checkpoint was removed for the storage
    quota (the run has no next step to stop at); the runner ends the job with ``watch.end_state()``."""

    def __init__(self, watch: QuotaWatch) -> None:
        super().__init__("the team's storage quota was reached at the run's last checkpoint")
        self.watch = watch


class QuotaWatch:
    """One running job's view of its team's GPU-hour and storage quotas (see the module docstring)."""

    def __init__(self, url: str, job_id: str, settings: Settings) -> None:
        self.url, self.job_id, self.settings = url, job_id, settings
        #: Set once a quota is reached: the job's should_stop is true from then on.
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._reached: Reached | None = None
        self._team: str | None = None
        self._due: float | None = None  # monotonic time the GPU-hour limit is projected to be reached
        self._total_steps: int | None = None

    @property
    def reached(self) -> Reached | None:
        with self._lock:
            return self._reached

    def _reach(self, reached: Reached) -> None:
        with self._lock:
            first = self._reached is None
            if first:
                self._reached = reached
        if first:
            log.warning(
                "job %s: the team's %s quota is reached; stopping the job", self.job_id, reached.quota
            )
        self.stop.set()

    def _team_id(self, s: Session) -> str | None:
        if self._team is None:
            self._team = s.scalar(select(FineTuningJob.team_id).where(FineTuningJob.id == self.job_id))
        return self._team

    # -- GPU-hours: the monitor's thread --

    def due(self) -> bool:
        """Whether the moment the team was projected to reach its GPU-hour limit has come."""
        due = self._due
        return due is not None and not self.stop.is_set() and time.monotonic() >= due

    def check_gpu_hours(self) -> None:
        """The team's GPU-hour use against its limit: stop the job at the limit, else project when the
        team's running jobs reach it. A database error skips this check (logged)."""
        self._due = None
        if self.stop.is_set():
            return
        try:
            with session_scope(self.url) as s:
                team = self._team_id(s)
                gpu = quotas.gpu_hours_now(s, team, self.settings) if team else None
        except Exception as e:
            log.warning(
                "job %s: GPU-hour quota not checked: %s",
                self.job_id,
                public_message(e),
                exc_info=not is_db_unavailable(e),
            )
            return
        if gpu is None:
            return
        if gpu.reached:
            self._reach(Reached("gpu_hours", gpu.limit_seconds, gpu.used_seconds))
        elif gpu.seconds_to_limit != float("inf"):
            self._due = time.monotonic() + gpu.seconds_to_limit

    # -- storage: the training thread --

    def guard(self, reporter: Callable[[Event], None]) -> Callable[[Event], None]:
        """``reporter`` behind the storage check of each checkpoint (rank 0 sees every checkpoint)."""

        def on_event(ev: Event) -> None:
            if isinstance(ev, RunStarted):
                self._total_steps = ev.total_steps
            elif isinstance(ev, CheckpointSaved) and not self._checkpoint_fits(ev):
                if self._total_steps is not None and ev.step >= self._total_steps:
                    raise QuotaReached(self)  # the last checkpoint: no next step to stop at
                return  # no row for a removed checkpoint; the loop stops at its next step
            elif (
                isinstance(ev, LogEvent)
                and ev.message.startswith("Cancelled at step")  # the loop's word for any stop
                and (reached := self.reached) is not None
            ):
                what = "GPU-hour" if reached.quota == "gpu_hours" else "storage"
                ev = replace(ev, message=f"Stopped {ev.message.removeprefix('Cancelled ')}: {what} quota")
            reporter(ev)

        return on_event

    def _checkpoint_fits(self, ev: CheckpointSaved) -> bool:
        """Whether the team is within its storage quota with checkpoint ``ev`` on disk; if not, the
        checkpoint is removed and the job stopped."""
        try:
            with session_scope(self.url) as s:
                team = self._team_id(s)
                room = quotas.storage_room(s, team, self.settings) if team else None
        except Exception as e:
            log.warning(
                "job %s: storage quota not checked at checkpoint %d: %s",
                self.job_id,
                ev.step,
                public_message(e),
                exc_info=not is_db_unavailable(e),
            )
            return True
        if room is None or room[1] <= room[0]:
            return True
        limit, stored = room
        _remove_checkpoint(Path(ev.path))
        self._reach(Reached("storage_bytes", limit, stored, step=ev.step))
        return False

    # -- the end state: the runner, in the end-state transaction --

    def end_state(self) -> Callable[[Session, FineTuningJob], None]:
        """Fail the job for the quota reached (see the module docstring)."""
        reached = self.reached
        assert reached is not None

        def end(s: Session, job: FineTuningJob) -> None:
            ckpt = s.scalars(
                select(JobCheckpoint)
                .where(JobCheckpoint.job_id == job.id)
                .order_by(JobCheckpoint.step_number.desc())
                .limit(1)
            ).first()
            kept = (
                f"checkpoint {ckpt.fine_tuned_model_checkpoint} kept"
                if ckpt is not None
                else "no checkpoint kept"
            )
            stopped = f"the job stopped at step {job.global_step}, {kept}"
            data: dict[str, Any] = {
                "quota": reached.quota,
                "step": job.global_step,
                "checkpoint": ckpt.fine_tuned_model_checkpoint if ckpt is not None else None,
            }
            if reached.quota == "gpu_hours":
                gpu = quotas.gpu_hours_now(s, job.team_id, self.settings)  # the use up to this end
                used = gpu.used_seconds if gpu is not None else reached.used
                fmt = quotas.format_gpu_hours
                message = (
                    f"GPU-hour quota of {reached.limit / 3600:g} reached: used {fmt(used / 3600)} "
                    f"GPU-hours in the last {self.settings.quota_period_days:g} days; {stopped}"
                )
                data.update(limit_gpu_hours=reached.limit / 3600, used_gpu_hours=used / 3600)
            else:
                message = (
                    f"Storage quota of {reached.limit:,.0f} bytes reached: checkpoint {reached.step} would "
                    f"have made it {reached.used:,.0f} bytes stored, so it was removed; {stopped}"
                )
                data.update(limit_bytes=int(reached.limit), used_bytes=int(reached.used))
            jobs.fail(s, job, QUOTA_CODE, message, param=reached.quota, event=message, data=data)

        return end


def _remove_checkpoint(path: Path) -> None:
    """Remove a checkpoint directory: renamed out of the checkpoints first (one step, so a crash leaves
    a ``.old-`` leftover the next run's clean-up removes, never a half-removed checkpoint), then deleted."""
    gone = path.with_name(f"{path.name}.old-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, gone)
    except FileNotFoundError:
        return
    shutil.rmtree(gone, ignore_errors=True)

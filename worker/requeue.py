"""What the worker task does once a job's runner has exited (:func:`settle_after_exit`).

A terminal job is left alone; a job taken away meanwhile too; a pending cancel is carried out. Else the
job is re-queued to resume from its last checkpoint:

- preempted (exit 75, or SIGTERM from a worker shutting down): the attempt is given back;
- interrupted (exit 69: the database was unreachable for longer than ``job_db_outage_seconds``): the
  attempt counts, but the job is never failed for it here;
- stopped by a full disk (exit 74: no space left while writing a checkpoint, the previous one kept):
  the job is held for a backoff (``disk_full_backoff_seconds``, doubled for each such re-queue in a
  row, at most 15 minutes; heartbeat kept, a cancel or the worker's shutdown ends it early), then
  re-queued with the attempt given back; after ``disk_full_max_requeues`` such re-queues in a row
  without a new checkpoint in between it fails with code ``disk_full``;
- any other exit (a crash, a kill): the attempt counts; with none left the job fails (``worker_lost``).

Each step is one transaction retried across database outages (:func:`worker.retry.retry_db`);
when the database stays away the job is left running, its heartbeat goes stale, and the reaper
re-queues it once the database is back. Does not import torch.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from store import jobs
from store.db import session_scope
from store.orm import FineTuningJob, JobEvent, JobStatus, utcnow
from store.settings import Settings
from worker.broker import Enqueue
from worker.dispatch import dispatch_job
from worker.job.exits import (
    EXIT_DB_UNAVAILABLE,
    EXIT_DISK_FULL,
    EXIT_PEER_LOST,
    EXIT_PREEMPTED,
    EXIT_WRONG_RANKS,
)
from worker.retry import DatabaseUnavailable, retry_db

log = logging.getLogger("zenflow.worker")

#: The longest backoff before a job stopped by a full disk is re-queued.
MAX_DISK_FULL_BACKOFF_SECONDS = 900.0


def describe_exit(rc: int) -> str:
    """A runner's return code in words (negative: the signal that killed it)."""
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        hint = " (out of memory?)" if -rc == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    hints = {
        EXIT_PEER_LOST: " (another rank of the job failed)",
        EXIT_WRONG_RANKS: " (the job asks for another number of ranks)",
    }
    return f"exit code {rc}{hints.get(rc, '')}"


def settle_after_exit(
    job_id: str, rc: int, hostname: str, settings: Settings, *, preempted: bool, enqueue: Enqueue
) -> str:
    """After the runner exited with ``rc`` (see the module docstring); what happened, for the logs:
    done, not-ours, cancelled, requeued, failed or db-unavailable. ``enqueue`` sends a re-queued job."""
    url = settings.resolved_database_url
    if rc == EXIT_DISK_FULL:
        return _after_disk_full(job_id, hostname, settings, enqueue)

    def settle() -> tuple[str, str | None]:
        with session_scope(url) as s:
            job = _ours(s, job_id, hostname)
            if isinstance(job, str):
                return job, None
            if rc == EXIT_PREEMPTED or (preempted and rc == -signal.SIGTERM):
                job.attempts = max(0, job.attempts - 1)  # preemption is not the job's fault
                why = "Training preempted (worker shutting down)"
            elif rc == EXIT_DB_UNAVAILABLE:  # the attempt counts, but the job is never failed for this
                why = (
                    f"Training interrupted: the database was unreachable for more than "
                    f"{settings.job_db_outage_seconds:g} s"
                )
            else:
                why = f"Training process ended abnormally ({describe_exit(rc)})"
                if job.attempts >= settings.max_job_attempts:
                    jobs.fail(
                        s, job, "worker_lost", f"{why} on attempt {job.attempts}/{settings.max_job_attempts}"
                    )
                    return "failed", None
            _catch_up_with_disk(job)
            return "requeued", jobs.requeue(s, job, why)

    outcome, queue = _retrying(settle, job_id, settings)
    if queue is not None:
        dispatch_job(url, job_id, queue, enqueue=enqueue)
    return outcome


def _retrying(fn: Callable[[], tuple[str, Any]], job_id: str, settings: Settings) -> tuple[str, Any]:
    """``fn()`` retried across database outages; ("db-unavailable", None) when the database stays away
    (the job is left running: its heartbeat goes stale and the reaper re-queues it once it is back)."""
    try:
        return retry_db(fn, window=settings.job_db_outage_seconds, what=f"job {job_id}: after its runner")
    except DatabaseUnavailable as e:
        log.error("job %s: %s; left for the reaper", job_id, e)
        return "db-unavailable", None


def _catch_up_with_disk(job: FineTuningJob) -> None:
    """A runner that could not reach the database at its end (interrupted, preempted during an outage)
    left a checkpoint newer than the row knows: the job resumes from there, so say so (the next run
    registers its row and writes the reports it saved)."""
    from trainer.run.checkpoint import latest_checkpoint

    try:
        ck = latest_checkpoint(Path(job.output_dir)) if job.output_dir else None
    except OSError:
        return
    if ck is not None and ck.step > job.global_step:
        job.global_step, job.last_checkpoint_path = ck.step, str(ck.path)


def _ours(s: Session, job_id: str, hostname: str) -> FineTuningJob | str:
    """The locked job row when it is still running here (a pending cancel is carried out), else what
    became of it: "done", "not-ours" or "cancelled"."""
    job = jobs.lock_job(s, job_id)
    if job is None or JobStatus(job.status).terminal:
        return "done"
    if job.status != JobStatus.running.value or job.worker_hostname != hostname:
        return "not-ours"
    if job.cancel_requested:
        jobs.cancel(s, job, f"Job cancelled at step {job.global_step}")
        return "cancelled"
    return job


def _disk_full_streak(s: Session, job: FineTuningJob) -> tuple[int, str]:
    """(How many disk-full re-queues in a row this one makes, the runner's message): the streak goes on
    while the job's newest checkpoint is the one of the previous disk-full re-queue."""
    rows = s.scalars(
        select(JobEvent.data)
        .where(JobEvent.job_id == job.id, JobEvent.level == "warning")
        .order_by(JobEvent.seq.desc())
        .limit(200)
    )
    message: str | None = None
    previous = 0
    for data in rows:
        if not isinstance(data, dict):
            continue
        if message is None and isinstance(data.get("disk_full"), str):
            message = data["disk_full"]
        if "disk_full_requeues" in data:
            if data.get("last_checkpoint") == job.last_checkpoint_path:
                previous = int(data["disk_full_requeues"])
            break
    return previous + 1, message or "no space left while writing a checkpoint"


def _after_disk_full(job_id: str, hostname: str, settings: Settings, enqueue: Enqueue) -> str:
    """The runner found no space for a checkpoint: wait a backoff holding the job, then re-queue it
    without counting the attempt; fail it after too many such re-queues in a row."""
    url, limit = settings.resolved_database_url, settings.disk_full_max_requeues

    def begin() -> tuple[str, Any]:
        with session_scope(url) as s:
            job = _ours(s, job_id, hostname)
            if isinstance(job, str):
                return job, None
            n, message = _disk_full_streak(s, job)
            if n > limit:
                jobs.fail(
                    s,
                    job,
                    "disk_full",
                    f"{message}; gave up after {limit} re-queues in a row without a new "
                    "checkpoint: free space for the jobs directory, then create the job again",
                )
                return "failed", None
            delay = min(settings.disk_full_backoff_seconds * 2 ** (n - 1), MAX_DISK_FULL_BACKOFF_SECONDS)
            job.heartbeat_at = utcnow()
            jobs.add_event(
                s,
                job.id,
                f"{message[:1].upper()}{message[1:]}; the previous checkpoint is kept. "
                f"Retrying in {delay:g} s (disk-full re-queue {n}/{limit}; attempts are not counted)",
                level="warning",
                data={
                    "disk_full_requeues": n,
                    "last_checkpoint": job.last_checkpoint_path,
                    "backoff_seconds": delay,
                },
            )
            return "wait", (delay, f"{message[:1].upper()}{message[1:]} (disk-full re-queue {n}/{limit})")

    outcome, detail = _retrying(begin, job_id, settings)
    if outcome != "wait":
        return str(outcome)
    delay, why = detail
    if not _hold(job_id, hostname, settings, delay):
        return "not-ours"

    def settle() -> tuple[str, str | None]:
        with session_scope(url) as s:
            job = _ours(s, job_id, hostname)
            if isinstance(job, str):
                return job, None
            job.attempts = max(0, job.attempts - 1)  # a full disk is not the job's fault
            return "requeued", jobs.requeue(s, job, why)

    outcome, queue = _retrying(settle, job_id, settings)
    if queue is not None:
        dispatch_job(url, job_id, queue, enqueue=enqueue)
    return outcome


_backoff_stop = threading.Event()
_in_backoff = threading.Event()


def _hold(job_id: str, hostname: str, settings: Settings, seconds: float) -> bool:
    """Keep the job's heartbeat fresh for ``seconds`` (or until a cancel, or the worker shutting down);
    False when the job was taken away meanwhile."""
    deadline = time.monotonic() + seconds
    _backoff_stop.clear()
    _in_backoff.set()
    try:
        while (left := deadline - time.monotonic()) > 0:
            if _backoff_stop.wait(min(left, settings.heartbeat_interval_seconds)):
                return True
            try:
                with session_scope(settings.resolved_database_url) as s:
                    res = s.execute(
                        update(FineTuningJob)
                        .where(
                            FineTuningJob.id == job_id,
                            FineTuningJob.worker_hostname == hostname,
                            FineTuningJob.status == JobStatus.running.value,
                        )
                        .values(heartbeat_at=utcnow())
                        .returning(FineTuningJob.cancel_requested)
                    )
                    row = res.one_or_none()
            except Exception:  # the database is away: the settle step after the wait retries
                log.warning("job %s: heartbeat during the disk-full backoff failed", job_id, exc_info=True)
                continue
            if row is None:
                return False
            if row.cancel_requested:
                return True
        return True
    finally:
        _in_backoff.clear()


def end_backoff() -> bool:
    """End the disk-full backoff of the job waiting in this process, if any (the worker is shutting
    down: it is re-queued at once); whether one was waiting."""
    if _in_backoff.is_set():
        _backoff_stop.set()
        return True
    return False

"""What the worker task does once a job's runner has exited (:func:`settle_after_exit`).

A terminal job is left alone; a job taken away meanwhile (or paused by its runner) too; a pending cancel
is carried out, then a pending pause (store.jobs.request_pause: the job is paused, its checkpoint kept). Else the
job is re-queued to resume from its last checkpoint:

- preempted (exit 75, or SIGTERM from a worker shutting down): the attempt is given back;
- interrupted (exit 69: the database was unreachable for longer than ``job_db_outage_seconds``): the
  attempt counts, but the job is never failed for it here;
- stopped by a full disk (exit 74: no space left while writing a checkpoint, the previous one kept
  if there was one): the run ends and the job is re-queued at once, the attempt given back, to wait
  off the GPU for a backoff (``disk_full_backoff_seconds``, doubled for each such re-queue in a row,
  at most 15 minutes): its ``not_before``, before which no worker claims it
  (:func:`store.jobs.held_back`) and after which the reaper's dispatcher sends its message
  (:mod:`worker.dispatch`). The GPU is free for other jobs meanwhile and the wait is no run, so
  nothing of it is billed (store.runs); a cancel meanwhile cancels the queued job at once. Its event
  says which checkpoint the job resumes from ("the previous checkpoint checkpoint-000060 (step 60) is
  kept", as the disk says), or that none exists and it restarts from step 0. After
  ``disk_full_max_requeues`` such re-queues in a row without a new checkpoint in between it fails
  with code ``disk_full``. (The attempt is given back as for a preemption: the job did nothing wrong,
  and a disk that fills up now and then must not use up its attempts; the streak bounds the loop.)
- any other exit (a crash, a kill): the attempt counts; with none left the job fails (``worker_lost``).

Each step is one transaction retried across database outages (:func:`worker.retry.retry_db`);
when the database stays away the job is left running, its heartbeat goes stale, and the reaper
re-queues it once the database is back. Does not import torch.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from store import jobs
from store.db import session_scope
from store.orm import FineTuningJob, JobEvent, JobStatus, utcnow
from store.runs import end_runs
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

#: The longest wait off the GPU of a job stopped by a full disk.
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


def _catch_up_with_disk(job: FineTuningJob, *, exact: bool = False) -> Path | None:
    """A runner that could not reach the database at its end (interrupted, preempted during an outage)
    left a checkpoint newer than the row knows: the job resumes from there, so say so (the next run
    registers its row and writes the reports it saved). ``exact``: the row's checkpoint becomes the
    newest complete one on disk whatever it was (none: no checkpoint; a full disk's re-queue tells
    which one the job resumes from). The newest complete checkpoint, None when none (or unreadable)."""
    from trainer.run.checkpoint import latest_checkpoint

    if not job.output_dir or (exact and not Path(job.output_dir).is_dir()):
        return None
    try:
        ck = latest_checkpoint(Path(job.output_dir))
    except OSError:
        return None
    if exact:
        job.last_checkpoint_path = str(ck.path) if ck is not None else None
    if ck is not None and ck.step > job.global_step:
        job.global_step, job.last_checkpoint_path = ck.step, str(ck.path)
    return ck.path if ck is not None else None


def _ours(s: Session, job_id: str, hostname: str) -> FineTuningJob | str:
    """The locked job row when it is still running here (a pending cancel or pause is carried out), else
    what became of it: "done", "paused", "not-ours" or "cancelled"."""
    job = jobs.lock_job(s, job_id)
    if job is None or JobStatus(job.status).terminal:
        return "done"
    if job.status == JobStatus.paused.value:
        return "paused"
    if job.status != JobStatus.running.value or job.worker_hostname != hostname:
        return "not-ours"
    if job.cancel_requested:
        jobs.cancel(s, job, f"Job cancelled at step {job.global_step}")
        return "cancelled"
    if job.pause_requested:
        _catch_up_with_disk(job)  # it resumes from the newest checkpoint on disk: say which
        why = "Training process ended before it could pause"
        jobs.pause(s, job, f"{why}; paused as requested, {jobs.resume_words(s, job)} when resumed")
        return "paused"
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
    """The runner found no space for a checkpoint: end the run and re-queue the job at once, to wait
    off the GPU (``not_before``) without counting the attempt; fail it after too many in a row."""
    url, limit = settings.resolved_database_url, settings.disk_full_max_requeues

    def settle() -> tuple[str, str | None]:
        with session_scope(url) as s:
            job = _ours(s, job_id, hostname)
            if isinstance(job, str):
                return job, None
            kept = _catch_up_with_disk(job, exact=True)
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
            end_runs(s, job.id)  # the run ends now (billed up to here); the wait starts after it
            not_before = utcnow() + timedelta(seconds=delay)
            job.not_before = not_before if delay > 0 else None
            what = f"{message[:1].upper()}{message[1:]}"
            jobs.add_event(
                s,
                job.id,
                f"{what}; {_kept_words(s, job, kept)}. The job waits {delay:g} s off the GPU before it "
                f"runs again (disk-full re-queue {n}/{limit}; attempts are not counted)",
                level="warning",
                data={
                    "disk_full_requeues": n,
                    "last_checkpoint": job.last_checkpoint_path,
                    "backoff_seconds": delay,
                    "not_before": not_before.isoformat(),
                },
            )
            job.attempts = max(0, job.attempts - 1)  # a full disk is not the job's fault
            queue = jobs.requeue(s, job, f"{what} (disk-full re-queue {n}/{limit})")
            return "requeued", (queue if delay <= 0 else None)

    outcome, queue = _retrying(settle, job_id, settings)
    if queue is not None:  # no wait: dispatched now; else worker.dispatch sends it once the wait is over
        dispatch_job(url, job_id, queue, enqueue=enqueue)
    return outcome


def _kept_words(s: Session, job: FineTuningJob, kept: Path | None) -> str:
    """What the job resumes from, in words: the checkpoint kept (its directory and step) or none."""
    step = jobs.resume_step(s, job)
    if not job.last_checkpoint_path or step == 0:
        return "no checkpoint exists yet; the job will restart from step 0"
    name = kept.name if kept is not None else Path(job.last_checkpoint_path).name
    return f"the previous checkpoint {name}{f' (step {step})' if step else ''} is kept"

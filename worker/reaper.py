"""Re-queue jobs whose worker died: running jobs with a stale heartbeat.

A worker killed outright (SIGKILL, node loss) cannot report; its training subprocess dies with it
(PR_SET_PDEATHSIG) and the job row stays ``running`` while ``heartbeat_at`` ages. :func:`reap_stale_jobs`
finds running jobs whose heartbeat is older than ``heartbeat_timeout_seconds`` and, under the row
lock (re-checked, so concurrent reapers do not double-enqueue), re-queues each to resume from its
last checkpoint, or fails it when ``max_job_attempts`` is used up, or marks it cancelled when a
cancel was pending, paused when a pause was (paused jobs are not running: the reaper and the
dispatcher leave them alone). ``own_hostname`` additionally reaps jobs recorded as running on that worker node
with a heartbeat from before ``own_before`` (the worker's start), however fresh: a worker calls it so
once at start-up, since a restarted node is not running any job it had.

Every worker runs :func:`start_reaper_thread` (started on ``worker_ready``; the embedded worker
starts its own; ``zenflow serve --reaper`` without a worker starts one too); each round it also runs
:func:`worker.dispatch.redispatch_lost_jobs`, which re-sends queued jobs whose broker message never
existed or was lost, and :func:`reap_gangs` (multi-node jobs' forming gangs past their deadline, running
gangs that lost a node). Does not import torch.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta

from sqlalchemy import func, or_, select

from store import gang, jobs
from store.db import session_scope
from store.orm import FineTuningJob, JobStatus, as_utc, utcnow
from store.runs import end_runs
from store.settings import Settings, get_settings
from worker.broker import Enqueue
from worker.dispatch import dispatch_job, redispatch_lost_jobs

log = logging.getLogger("zenflow.reaper")


def reap_stale_jobs(
    *,
    settings: Settings | None = None,
    own_hostname: str | None = None,
    own_before: datetime | None = None,
    now: datetime | None = None,
    enqueue: Enqueue | None = None,
) -> list[str]:
    """Re-queue (or fail / cancel) running jobs that lost their worker; the ids of jobs re-queued."""
    settings = settings or get_settings()
    url = settings.resolved_database_url
    now = now or utcnow()
    cutoff = now - timedelta(seconds=settings.heartbeat_timeout_seconds)
    beat = func.coalesce(FineTuningJob.heartbeat_at, FineTuningJob.started_at, FineTuningJob.created_at)
    cond = beat < cutoff
    own_before = own_before or now
    if own_hostname:
        cond = or_(cond, (FineTuningJob.worker_hostname == own_hostname) & (beat < own_before))
    with session_scope(url) as s:
        ids = list(
            s.scalars(select(FineTuningJob.id).where(FineTuningJob.status == JobStatus.running.value, cond))
        )
    requeued: list[str] = []
    for job_id in ids:
        queue: str | None = None
        with session_scope(url) as s:
            job = jobs.lock_job(s, job_id)
            if job is None or job.status != JobStatus.running.value:
                continue
            last = as_utc(job.heartbeat_at or job.started_at or job.created_at)
            mine = (
                bool(own_hostname)
                and job.worker_hostname == own_hostname
                and last is not None
                and last < own_before
            )
            if not mine and last is not None and last >= cutoff:
                continue
            age = f"{(now - last).total_seconds():.0f}s" if last is not None else "ever"
            why = f"Worker {job.worker_hostname} lost (no heartbeat for {age})"
            end_runs(s, job.id, now=last)  # billed up to its last sign of life, not to this round
            if job.cancel_requested:
                jobs.cancel(s, job, f"{why}; job cancelled")
            elif job.pause_requested:
                jobs.pause(s, job, f"{why}; paused as requested, {jobs.resume_words(s, job)} when resumed")
            elif job.attempts >= settings.max_job_attempts:
                jobs.fail(
                    s, job, "worker_lost", f"{why} on attempt {job.attempts}/{settings.max_job_attempts}"
                )
            else:
                queue = jobs.requeue(s, job, why)
        if queue is not None:
            dispatch_job(url, job_id, queue, enqueue=enqueue)
            requeued.append(job_id)
            log.warning("re-queued job %s (stale heartbeat)", job_id)
    return requeued


def reap_gangs(
    *, settings: Settings | None = None, now: datetime | None = None, enqueue: Enqueue | None = None
) -> list[str]:
    """Multi-node jobs (store.gang): dissolve forming gangs past ``gang_form_timeout_seconds`` or with a
    stale member (their job waits its turn again, not counted, its message sent again), and re-queue
    running ones a member of which stopped beating its slot (a node lost mid-job: the attempt counts;
    its other nodes' ranks are stopped by the launch's PeerWatch, or the job's heartbeat stops). The
    ids of the jobs sent again."""
    settings = settings or get_settings()
    url = settings.resolved_database_url
    sent: list[tuple[str, str]] = []
    with session_scope(url) as s:
        for job_id in gang.expire_forming(s, settings, now=now):
            job = s.get(FineTuningJob, job_id)
            if job is not None:
                sent.append((job_id, job.queue))
    with session_scope(url) as s:
        lost = gang.lost_running(s, settings, now=now)
    for job_id in lost:
        with session_scope(url) as s:
            job = jobs.lock_job(s, job_id)
            if job is None or job_id not in gang.lost_running(s, settings, now=now):
                continue
            why = "A node of its gang was lost (no heartbeat)"
            if job.cancel_requested:
                jobs.cancel(s, job, f"{why}; job cancelled")
            elif job.pause_requested:
                jobs.pause(s, job, f"{why}; paused as requested, {jobs.resume_words(s, job)} when resumed")
            elif job.attempts >= settings.max_job_attempts:
                jobs.fail(
                    s, job, "worker_lost", f"{why} on attempt {job.attempts}/{settings.max_job_attempts}"
                )
            else:
                sent.append((job_id, jobs.requeue(s, job, why)))
    for job_id, queue in sent:
        dispatch_job(url, job_id, queue, enqueue=enqueue)
        log.warning("job %s sent again (its gang was released or lost a node)", job_id)
    return [j for j, _ in sent]


class ReaperThread(threading.Thread):
    """Every ``interval`` seconds: reap_stale_jobs (own_hostname only on the first round), then
    worker.dispatch.redispatch_lost_jobs (queued jobs without a message in the broker)."""

    def __init__(self, *, own_hostname: str | None, interval: float, settings: Settings | None) -> None:
        super().__init__(name="zenflow-reaper", daemon=True)
        self.own_hostname, self.interval, self.settings = own_hostname, interval, settings
        self._stop_event = threading.Event()
        self.started = utcnow()

    def run(self) -> None:
        own = self.own_hostname
        while not self._stop_event.is_set():
            try:
                reap_stale_jobs(settings=self.settings, own_hostname=own, own_before=self.started)
                own = None
                reap_gangs(settings=self.settings)
            except Exception:
                log.exception("reaper round failed")
            try:
                redispatch_lost_jobs(settings=self.settings)
            except Exception:
                log.exception("dispatch reconcile round failed")
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()


def start_reaper_thread(
    *, own_hostname: str | None = None, interval: float | None = None, settings: Settings | None = None
) -> ReaperThread:
    """Start the periodic reaper (default interval: half the heartbeat timeout, at least 1 s)."""
    s = settings or get_settings()
    t = ReaperThread(
        own_hostname=own_hostname,
        interval=interval if interval is not None else max(1.0, s.heartbeat_timeout_seconds / 2),
        settings=settings,
    )
    t.start()
    return t

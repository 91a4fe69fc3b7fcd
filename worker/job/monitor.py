"""The job process's watch over its own row: heartbeats, and polling for a cancel, a pause or a lost
claim (a cancel or a pause request makes ``should_stop`` true: the loop stops at its next step).

While the database is unreachable the monitor keeps trying every poll interval. An outage longer than
``outage_seconds`` sets ``interrupted`` (the run stops as interrupted). One longer than the reaper's
heartbeat timeout but within the window can end with the job re-queued by the reaper meanwhile: the
first poll after the outage sees the job is no longer ours and the process exits at once
(:func:`exit_lost`); the writes waiting in this process are guarded the same way
(:mod:`worker.job.writer`), so nothing of this run is written into the job's next run.

With a :class:`~worker.job.quota_watch.QuotaWatch` it also checks the team's GPU-hour quota after each
heartbeat, and again at the moment the team's running jobs are projected to reach it; once a quota is
reached ``should_stop`` is true (the job stops like a cancel and fails ``quota_exceeded``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import NoReturn

from sqlalchemy import select

from store import jobs
from store.db import session_scope
from store.orm import FineTuningJob, JobStatus
from worker.errors import is_db_unavailable, public_message
from worker.job.exits import EXIT_LOST
from worker.job.quota_watch import QuotaWatch

log = logging.getLogger("zenflow.job_runner")


def exit_lost(job_id: str) -> NoReturn:
    """Leave at once, writing nothing more: another process may own the job's output directory now."""
    log.error("job %s is no longer ours: exiting", job_id)
    os._exit(EXIT_LOST)


class JobMonitor(threading.Thread):
    """Heartbeats and cancel and pause polling for one running job, in the background."""

    def __init__(
        self,
        job_id: str,
        url: str,
        hostname: str,
        heartbeat_interval: float,
        poll_interval: float = 1.0,
        *,
        outage_seconds: float = 300.0,
        interrupted: threading.Event | None = None,
        quota: QuotaWatch | None = None,
    ):
        super().__init__(name=f"zenflow-monitor-{job_id}", daemon=True)
        self.job_id, self.url, self.hostname = job_id, url, hostname
        self.heartbeat_interval = heartbeat_interval
        self.poll_interval = min(poll_interval, heartbeat_interval)
        self.outage_seconds = outage_seconds
        self.cancel = threading.Event()
        #: A user asked the job to pause (``pause_requested``): it stops as for a cancel, then is paused.
        self.pause = threading.Event()
        self.lost = threading.Event()
        self.preempted = threading.Event()
        #: Set when the database has been unreachable for longer than outage_seconds.
        self.interrupted = interrupted or threading.Event()
        #: The team's quotas: GPU-hours checked here, storage at each checkpoint (its guard).
        self.quota = quota
        self._stop_event = threading.Event()

    def should_stop(self) -> bool:
        quota = self.quota is not None and self.quota.stop.is_set()
        asked = self.cancel.is_set() or self.pause.is_set()
        return asked or self.preempted.is_set() or self.interrupted.is_set() or quota

    def paused(self) -> bool:
        """Whether the run stops for a user's pause (a cancel asked too wins: the job is cancelled)."""
        return self.pause.is_set() and not self.cancel.is_set()

    def beat(self) -> None:
        with session_scope(self.url) as s:
            jobs.beat(s, self.job_id, self.hostname)

    def poll(self) -> None:
        with session_scope(self.url) as s:
            row = s.execute(
                select(
                    FineTuningJob.status,
                    FineTuningJob.cancel_requested,
                    FineTuningJob.pause_requested,
                    FineTuningJob.worker_hostname,
                ).where(FineTuningJob.id == self.job_id)
            ).one_or_none()
        if row is None or row.status != JobStatus.running.value or row.worker_hostname != self.hostname:
            # Re-queued (or finished) elsewhere: another process may own the output directory now,
            # so stop at once without writing anything more.
            self.lost.set()
            log.error(
                "job %s is %s on %s",
                self.job_id,
                row.status if row else "deleted",
                row.worker_hostname if row else None,
            )
            exit_lost(self.job_id)
        if row.cancel_requested:
            self.cancel.set()
        if row.pause_requested:
            self.pause.set()

    def run(self) -> None:
        last_beat = 0.0
        failing_since: float | None = None
        while not self._stop_event.is_set():
            now = time.monotonic()
            try:
                if now - last_beat >= self.heartbeat_interval:
                    self.beat()
                    last_beat = now
                    if self.quota is not None:
                        self.quota.check_gpu_hours()
                elif self.quota is not None and self.quota.due():
                    self.quota.check_gpu_hours()
                self.poll()
            except Exception as e:  # the database is away: keep trying every round
                if failing_since is None:
                    failing_since = now
                    log.warning(
                        "job monitor: %s; retrying", public_message(e), exc_info=not is_db_unavailable(e)
                    )
                elif now - failing_since > self.outage_seconds and not self.interrupted.is_set():
                    log.error(
                        "job monitor: database unavailable for more than %g s: interrupting the run",
                        self.outage_seconds,
                    )
                    self.interrupted.set()
            else:
                if failing_since is not None:
                    log.warning("job monitor: database back after %.1f s", now - failing_since)
                failing_since = None
            self._stop_event.wait(self.poll_interval)

    def stop(self) -> None:
        """Stop polling and wait for the thread (before writing the end state: a poll that saw
        our own terminal write would take it for a lost job)."""
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(30)

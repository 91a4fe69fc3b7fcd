"""The job process's watch over its own row: heartbeats, and polling for a cancel or a lost claim."""

from __future__ import annotations

import logging
import os
import threading
import time

from sqlalchemy import select, update

from store.db import session_scope
from store.models import FineTuningJob, JobStatus, utcnow

log = logging.getLogger("zenflow.job_runner")

#: Exit code of a job process whose job was taken away (re-queued or finished elsewhere).
EXIT_LOST = 3


class JobMonitor(threading.Thread):
    """Heartbeats and cancel polling for one running job, in the background."""

    def __init__(self, job_id: str, url: str, hostname: str, heartbeat_interval: float, poll_interval: float = 1.0):
        super().__init__(name=f"zenflow-monitor-{job_id}", daemon=True)
        self.job_id, self.url, self.hostname = job_id, url, hostname
        self.heartbeat_interval = heartbeat_interval
        self.poll_interval = min(poll_interval, heartbeat_interval)
        self.cancel = threading.Event()
        self.lost = threading.Event()
        self.preempted = threading.Event()
        self._stop_event = threading.Event()

    def should_stop(self) -> bool:
        return self.cancel.is_set() or self.preempted.is_set()

    def beat(self) -> None:
        with session_scope(self.url) as s:
            s.execute(
                update(FineTuningJob)
                .where(FineTuningJob.id == self.job_id, FineTuningJob.worker_hostname == self.hostname)
                .values(heartbeat_at=utcnow())
            )

    def poll(self) -> None:
        with session_scope(self.url) as s:
            row = s.execute(
                select(FineTuningJob.status, FineTuningJob.cancel_requested, FineTuningJob.worker_hostname).where(
                    FineTuningJob.id == self.job_id
                )
            ).one_or_none()
        if row is None or row.status != JobStatus.running.value or row.worker_hostname != self.hostname:
            # Re-queued (or finished) elsewhere: another process may own the output directory now,
            # so stop at once without writing anything more.
            self.lost.set()
            log.error("job %s is no longer ours (%s on %s): exiting", self.job_id,
                      row.status if row else "deleted", row.worker_hostname if row else None)
            os._exit(EXIT_LOST)
        if row.cancel_requested:
            self.cancel.set()

    def run(self) -> None:
        last_beat = 0.0
        while not self._stop_event.is_set():
            try:
                now = time.monotonic()
                if now - last_beat >= self.heartbeat_interval:
                    self.beat()
                    last_beat = now
                self.poll()
            except Exception:  # a database hiccup: try again next round
                log.exception("job monitor: database error")
            self._stop_event.wait(self.poll_interval)

    def stop(self) -> None:
        """Stop polling and wait for the thread (before writing the end state: a poll that saw
        our own terminal write would take it for a lost job)."""
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(30)

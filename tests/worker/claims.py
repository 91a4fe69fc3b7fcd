"""Claiming a job the way a worker decides to run it, for tests that need a job in its running state."""

from __future__ import annotations

from store import jobs
from store.db import session_scope
from store.settings import Settings


def claim_job(job_id: str, hostname: str, settings: Settings) -> jobs.Claim:
    """:func:`store.jobs.claim` under the row lock, with the worker's settings: "claimed" or why not."""
    with session_scope(settings.resolved_database_url) as s:
        return jobs.claim(
            s,
            jobs.lock_job(s, job_id),
            hostname,
            max_attempts=settings.max_job_attempts,
            heartbeat_timeout_seconds=settings.heartbeat_timeout_seconds,
        )

"""A claim meeting a job whose row another transaction holds (store.jobs.claim_next, real PostgreSQL):
the message is held and re-checked, never consumed with the job left queued and no message for it.

The API stamps a job's dispatch (``mark_dispatched``) right after enqueueing its message; a worker can
take that message while the stamp's row lock is held. Passing the job over then left it queued with no
message until the reaper's grace (the pause flow under a loaded CI box waited 300 s for a step)."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from store import jobs
from store.db import session_scope
from store.settings import Settings
from tests.worker.test_worker import get_job, make_job, sums_file


@pytest.fixture
def settings(service_env: dict[str, str]) -> Settings:
    from store.settings import get_settings

    return get_settings()


def test_a_job_whose_row_is_locked_is_held_then_claimed_once_free(settings: Settings, tmp_path: Path) -> None:
    url = settings.resolved_database_url
    queue = f"zf-lock-{secrets.token_hex(4)}"
    job_id = make_job(url, sums_file(tmp_path / "d.jsonl", n=8), queue=queue)
    host = "w@claim-test"
    with session_scope(url) as api:  # as the API's dispatch stamp: the row locked until it commits
        assert jobs.lock_job(api, job_id) is not None
        with session_scope(url) as s:
            got = jobs.claim_next(s, host, settings, message_job_id=job_id, queue=queue)
        assert (got.outcome, got.job_id, got.queue) == (jobs.Claim.held, job_id, queue)
    assert get_job(url, job_id).status == "queued"
    with session_scope(url) as s:
        got = jobs.claim_next(s, host, settings, message_job_id=job_id, queue=queue)
    assert (got.outcome, got.job_id) == (jobs.Claim.claimed, job_id)
    assert get_job(url, job_id).status == "running"
    with session_scope(url) as s:  # nothing of this test left running for the session's reapers
        job = jobs.lock_job(s, job_id)
        assert job is not None
        jobs.cancel(s, job, "test over")

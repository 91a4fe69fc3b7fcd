"""The reaper's side of gang scheduling (worker.reaper.reap_gangs), against the real PostgreSQL: a
forming gang past its deadline is released and its job's message sent again; a running gang whose
member stopped beating is re-queued with the attempt counted and sent again."""

from __future__ import annotations

import secrets
from datetime import timedelta
from pathlib import Path

import pytest

from store import gang, jobs
from store.db import session_scope
from store.orm import JobStatus, utcnow
from store.settings import Settings
from tests.worker.test_worker import get_job, make_job, sums_file
from worker.reaper import reap_gangs


@pytest.fixture
def settings(service_env: dict[str, str]) -> Settings:
    from store.settings import get_settings

    return get_settings()


def _take(url: str, settings: Settings, queue: str, host: str) -> None:
    with session_scope(url) as s:
        gang.next_gang(s, host, settings, queue=queue, endpoint="127.0.0.1:29500")


def test_the_reaper_releases_late_gangs_and_requeues_gangs_that_lost_a_node(
    settings: Settings, tmp_path: Path
) -> None:
    url, queue = settings.resolved_database_url, f"q-{secrets.token_hex(4)}"
    data = sums_file(tmp_path / "d.jsonl")
    forming = make_job(url, data, queue=queue, resources={"nodes": 2, "gpus": 1})
    sent: list[tuple[str, str]] = []
    try:
        _take(url, settings, queue, "a@reap")
        assert reap_gangs(settings=settings, enqueue=lambda j, q: sent.append((j, q))) == []  # in time
        late = utcnow() + timedelta(seconds=settings.gang_form_timeout_seconds + 1)
        assert reap_gangs(settings=settings, now=late, enqueue=lambda j, q: sent.append((j, q))) == [forming]
        assert sent == [(forming, queue)]
        job = get_job(url, forming)
        assert (job.status, job.attempts) == ("queued", 0) and job.dispatched_at is not None  # sent again

        _take(url, settings, queue, "a@reap")
        _take(url, settings, queue, "b@reap")
        assert get_job(url, forming).status == "running"
        stale = utcnow() + timedelta(seconds=settings.heartbeat_timeout_seconds + 1)
        with session_scope(url) as s:  # node 0 beats on; node 1 went silent
            member = gang.view(s, forming, "a@reap")
            assert member is not None
            gang.beat(s, member, "a@reap", now=stale)
        assert reap_gangs(settings=settings, now=stale, enqueue=lambda j, q: sent.append((j, q))) == [forming]
        job = get_job(url, forming)
        assert (job.status, job.attempts) == ("queued", 1) and sent[-1] == (forming, queue)
    finally:
        with session_scope(url) as s:
            job = jobs.lock_job(s, forming)
            if job is not None and not JobStatus(job.status).terminal:
                jobs.cancel(s, job, "test over")

"""Gang scheduling through the database (store.gang), against the real PostgreSQL: a multi-node job is
started only when all its nodes joined, a gang that cannot form releases its slots and the job keeps
its queue position and attempts, a stale member dissolves a forming gang or loses a running one."""

from __future__ import annotations

import secrets
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select

from store import gang, jobs
from store.db import session_scope
from store.fairshare import fair_order
from store.orm import JobNode, JobRun, JobStatus, utcnow
from store.settings import Settings
from tests.worker.test_worker import get_job, make_job, sums_file

GANG = {"nodes": 2, "gpus": 1}


@pytest.fixture
def settings(service_env: dict[str, str]) -> Settings:
    from store.settings import get_settings

    return get_settings()


@pytest.fixture
def queue() -> str:
    return f"q-{secrets.token_hex(4)}"


def _next(
    url: str, settings: Settings, queue: str, host: str, **kw: object
) -> tuple[jobs.NextClaim, gang.Member | None]:
    with session_scope(url) as s:
        return gang.next_gang(s, host, settings, queue=queue, endpoint=f"127.0.0.1:{29500}", **kw)  # type: ignore[arg-type]


def _slots(url: str, job_id: str) -> list[tuple[int, int, str]]:
    with session_scope(url) as s:
        rows = s.scalars(select(JobNode).where(JobNode.job_id == job_id).order_by(JobNode.node_rank))
        return [(r.attempt, r.node_rank, r.worker_hostname) for r in rows]


def _settle(url: str, *job_ids: str) -> None:
    with session_scope(url) as s:
        for job_id in job_ids:
            job = jobs.lock_job(s, job_id)
            if job is not None and not JobStatus(job.status).terminal:
                jobs.cancel(s, job, "test over")


def _positions(url: str, queue: str) -> list[str]:
    with session_scope(url) as s:
        order = fair_order(queue)
        return list(s.scalars(select(order.c.job_id).order_by(order.c.pos)))


def test_a_gang_starts_only_when_every_node_joined(settings: Settings, queue: str, tmp_path: Path) -> None:
    url = settings.resolved_database_url
    job_id = make_job(url, sums_file(tmp_path / "d.jsonl"), queue=queue, resources=GANG)
    try:
        first, node0 = _next(url, settings, queue, "a@host1")
        assert first.outcome is jobs.Claim.forming and first.job_id == job_id
        assert node0 is not None and (node0.node_rank, node0.started) == (0, False)
        assert node0.rdzv_endpoint == "127.0.0.1:29500" and node0.run_id == f"{job_id}-a1"
        job = get_job(url, job_id)
        assert (job.status, job.attempts) == ("queued", 0)  # nothing counted, nothing held while forming
        with session_scope(url) as s:
            assert s.scalar(select(func.count()).select_from(JobRun).where(JobRun.job_id == job_id)) == 0

        second, node1 = _next(url, settings, queue, "b@host2")
        assert second.outcome is jobs.Claim.joined and second.job_id == job_id
        assert node1 is not None and (node1.node_rank, node1.started) == (1, True)
        assert node1.rdzv_endpoint == "127.0.0.1:29500" and node1.run_id == node0.run_id
        job = get_job(url, job_id)
        assert (job.status, job.attempts, job.worker_hostname) == ("running", 1, "a@host1")
        with session_scope(url) as s:
            runs = list(s.scalars(select(JobRun).where(JobRun.job_id == job_id)))
            assert [r.gpus for r in runs] == [2]  # one run holding both nodes' GPUs
            seen = gang.view(s, job_id, "a@host1")
        assert seen is not None and seen.started and seen.node_rank == 0
        assert _slots(url, job_id) == [(1, 0, "a@host1"), (1, 1, "b@host2")]

        third, none = _next(url, settings, queue, "c@host3")  # a full, running gang is not joined again
        assert (third.outcome, none) == (jobs.Claim.idle, None)
    finally:
        _settle(url, job_id)


def test_a_gang_that_cannot_form_releases_and_the_job_keeps_its_place(
    settings: Settings, queue: str, tmp_path: Path
) -> None:
    url = settings.resolved_database_url
    data = sums_file(tmp_path / "d.jsonl")
    big = make_job(url, data, queue=queue, resources=GANG)
    later = make_job(url, data, queue=queue)  # another team's single-node job, created after
    try:
        created = get_job(url, big).created_at
        assert _next(url, settings, queue, "a@host1")[0].outcome is jobs.Claim.forming
        with session_scope(url) as s:  # before the deadline nothing is released
            assert gang.expire_forming(s, settings) == []
        with session_scope(url) as s:
            assert gang.beat(s, gang.view(s, big, "a@host1") or pytest.fail("no slot"), "a@host1")

        past = utcnow() + timedelta(seconds=settings.gang_form_timeout_seconds + 1)
        with session_scope(url) as s:
            assert gang.expire_forming(s, settings, now=past) == [big]
        job = get_job(url, big)
        assert (job.status, job.attempts, job.created_at, job.dispatched_at) == ("queued", 0, created, None)
        assert _slots(url, big) == []
        assert _positions(url, queue) == [big, later]  # its place in fair share is kept
        with session_scope(url) as s:
            assert gang.view(s, big, "a@host1") is None
            assert not gang.beat(s, gang.Member(big, 1, 0, 2, "", False), "a@host1")  # told it is gone

        # its turn again: the next worker opens a new gang for the same (uncounted) attempt
        again, node0 = _next(url, settings, queue, "b@host2")
        assert again.outcome is jobs.Claim.forming and again.job_id == big
        assert node0 is not None and node0.run_id == f"{big}-a1"
    finally:
        _settle(url, big, later)


def test_a_forming_gang_is_joined_before_fair_share_work(
    settings: Settings, queue: str, tmp_path: Path
) -> None:
    url = settings.resolved_database_url
    data = sums_file(tmp_path / "d.jsonl")
    big = make_job(url, data, queue=queue, resources=GANG)
    small = make_job(url, data, queue=queue)
    try:
        assert _next(url, settings, queue, "a@host1")[0].job_id == big
        joined = _next(url, settings, queue, "b@host2")[0]  # the oldest forming gang first
        assert (joined.outcome, joined.job_id) == (jobs.Claim.joined, big)
        single = _next(url, settings, queue, "c@host3")[0]  # then fair-share work as before
        assert (single.outcome, single.job_id) == (jobs.Claim.claimed, small)
        assert get_job(url, small).worker_hostname == "c@host3"
    finally:
        _settle(url, big, small)


def test_a_stale_member_dissolves_a_forming_gang_and_loses_a_running_one(
    settings: Settings, queue: str, tmp_path: Path
) -> None:
    url = settings.resolved_database_url
    job_id = make_job(url, sums_file(tmp_path / "d.jsonl"), queue=queue, resources={"nodes": 3, "gpus": 1})
    try:
        stale = utcnow() + timedelta(seconds=settings.heartbeat_timeout_seconds + 1)
        _next(url, settings, queue, "a@host1")
        _next(url, settings, queue, "b@host2")
        with session_scope(url) as s:  # node 1 beats later, node 0 does not: node 0 went stale
            assert gang.beat(
                s, gang.view(s, job_id, "b@host2") or pytest.fail("no slot"), "b@host2", now=stale
            )
            assert gang.expire_forming(s, settings, now=stale) == [job_id]
        assert _slots(url, job_id) == []

        for host in ("a@host1", "b@host2", "c@host3"):
            _next(url, settings, queue, host)
        assert get_job(url, job_id).status == "running"
        with session_scope(url) as s:
            assert gang.lost_running(s, settings) == []
            for host in ("a@host1", "c@host3"):
                gang.beat(s, gang.view(s, job_id, host) or pytest.fail("no slot"), host, now=stale)
            assert gang.lost_running(s, settings, now=stale) == [job_id]  # b stopped beating
            job = jobs.lock_job(s, job_id)
            assert job is not None
            jobs.requeue(s, job, "node 1 of its gang was lost")
        job = get_job(url, job_id)
        assert (job.status, job.attempts) == ("queued", 1)  # the lost attempt counts
        nxt, member = _next(url, settings, queue, "c@host3")
        assert nxt.outcome is jobs.Claim.forming and member is not None and member.run_id == f"{job_id}-a2"
    finally:
        _settle(url, job_id)


def test_a_cancel_while_forming_settles_the_job_without_starting_it(
    settings: Settings, queue: str, tmp_path: Path
) -> None:
    url = settings.resolved_database_url
    job_id = make_job(url, sums_file(tmp_path / "d.jsonl"), queue=queue, resources=GANG)
    _next(url, settings, queue, "a@host1")
    with session_scope(url) as s:
        job = jobs.lock_job(s, job_id)
        assert job is not None
        jobs.request_cancel(s, job)  # a queued job is cancelled at once
    assert get_job(url, job_id).status == "cancelled"
    second, member = _next(url, settings, queue, "b@host2")
    assert (second.outcome, member) == (jobs.Claim.idle, None)
    with session_scope(url) as s:
        assert gang.forming(s, queue) == []

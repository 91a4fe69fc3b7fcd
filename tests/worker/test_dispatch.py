"""worker.dispatch against the real PostgreSQL and Redis (and the embedded SQLite + kombu SQLAlchemy
broker): queued jobs never handed to the broker, or whose message the broker lost, are dispatched
again, once; jobs whose message is still there are left alone. Time passes through ``now``."""

from __future__ import annotations

import base64
import json
import secrets
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select, text, update

from store.db import get_engine, session_scope
from store.orm import Base, FineTuningJob, JobEvent, utcnow
from store.settings import Settings
from tests.support import database_with_schema
from tests.worker.claims import claim_job
from tests.worker.test_worker import get_job, make_job, sums_file
from worker.dispatch import (
    LOST_EVENT,
    NEVER_SENT_EVENT,
    broker_message_counts,
    dispatch_job,
    redispatch_lost_jobs,
)

GRACE = 30.0


@pytest.fixture(scope="module")
def db_url() -> Iterator[str]:
    """A private database: the reconciler scans every queued job, so no other test's jobs may be there."""
    with database_with_schema("zf_dispatch") as url:
        yield url


@pytest.fixture
def settings(db_url: str, redis_broker_url: str, unique_queue: str, tmp_path: Path) -> Iterator[Settings]:
    """Settings on the private database and the local Redis; worker.broker's Celery app uses them."""
    from worker.broker import configure_celery

    s = Settings(
        _env_file=None,
        data_dir=tmp_path / "var",
        database_url=db_url,  # type: ignore[call-arg]
        broker_url=redis_broker_url,
        default_queue=unique_queue,
        dispatch_grace_seconds=GRACE,
    )
    configure_celery(s)
    yield s
    configure_celery()
    with session_scope(db_url) as sess:  # the next test starts with no queued jobs
        sess.execute(update(FineTuningJob).values(status="cancelled"))


@pytest.fixture
def rds(redis_broker_url: str):  # type: ignore[no-untyped-def]
    import redis

    return redis.Redis.from_url(redis_broker_url)


def queued_ids(rds, queue: str) -> list[str]:  # type: ignore[no-untyped-def]
    """The job ids of the messages waiting in a Redis queue."""
    out = []
    for raw in rds.lrange(queue, 0, -1):
        msg = json.loads(raw)
        args = json.loads(base64.b64decode(msg["body"]))[0]
        out.append(args[0])
    return out


def events(url: str, job_id: str, message: str) -> int:
    with session_scope(url) as s:
        return len(
            s.scalars(select(JobEvent.id).where(JobEvent.job_id == job_id, JobEvent.message == message)).all()
        )


def later(seconds: float = GRACE + 1) -> object:
    return utcnow() + timedelta(seconds=seconds)


def age_dispatch(url: str, job_id: str, seconds: float = GRACE + 5) -> None:
    with session_scope(url) as s:
        s.execute(
            update(FineTuningJob)
            .where(FineTuningJob.id == job_id)
            .values(dispatched_at=utcnow() - timedelta(seconds=seconds))
        )


def test_undispatched_job_is_dispatched_after_the_grace(settings: Settings, tmp_path: Path, rds) -> None:  # type: ignore[no-untyped-def]
    url, q = settings.resolved_database_url, settings.default_queue
    job = make_job(url, sums_file(tmp_path / "d.jsonl"), queue=q)  # committed; the API died before enqueue
    assert redispatch_lost_jobs(settings=settings) == []  # within the grace: the API may be enqueueing now
    assert rds.llen(q) == 0
    assert redispatch_lost_jobs(settings=settings, now=later()) == [job]  # type: ignore[arg-type]
    assert queued_ids(rds, q) == [job]
    assert get_job(url, job).dispatched_at is not None and events(url, job, NEVER_SENT_EVENT) == 1
    # Its message is in the broker now: nothing more to do, however late.
    assert redispatch_lost_jobs(settings=settings, now=later(3600)) == []  # type: ignore[arg-type]
    assert queued_ids(rds, q) == [job]


def test_lost_message_is_redispatched_once_intact_queue_untouched(
    settings: Settings,
    tmp_path: Path,
    rds,  # type: ignore[no-untyped-def]
) -> None:
    url, lost_q = settings.resolved_database_url, settings.default_queue
    kept_q = f"zf-test-{secrets.token_hex(6)}"
    try:
        data = sums_file(tmp_path / "d.jsonl")
        lost, kept = make_job(url, data, queue=lost_q), make_job(url, data, queue=kept_q)
        for j, q in ((lost, lost_q), (kept, kept_q)):
            dispatch_job(url, j, q)
            age_dispatch(url, j)
        assert redispatch_lost_jobs(settings=settings) == []  # both messages are there
        rds.delete(lost_q)  # the broker loses one queue's messages (a restart without persistence, FLUSHDB)
        assert redispatch_lost_jobs(settings=settings) == [lost]
        assert queued_ids(rds, lost_q) == [lost] and queued_ids(rds, kept_q) == [kept]
        assert events(url, lost, LOST_EVENT) == 1 and events(url, kept, LOST_EVENT) == 0
        # The next rounds find the counts matching: no second copy.
        assert redispatch_lost_jobs(settings=settings) == []
        assert redispatch_lost_jobs(settings=settings, now=later(3600)) == []  # type: ignore[arg-type]
        assert queued_ids(rds, lost_q) == [lost] and events(url, lost, LOST_EVENT) == 1
    finally:
        rds.delete(kept_q, f"_kombu.binding.{kept_q}", f"_kombu.binding_permanent.{kept_q}")


def test_recent_dispatch_is_not_suspected(settings: Settings, tmp_path: Path, rds) -> None:  # type: ignore[no-untyped-def]
    """A message dispatched within the grace may be in a worker's hands, not yet claimed: not re-sent."""
    url, q = settings.resolved_database_url, settings.default_queue
    job = make_job(url, sums_file(tmp_path / "d.jsonl"), queue=q)
    dispatch_job(url, job, q)
    rds.delete(q)
    assert redispatch_lost_jobs(settings=settings) == []
    assert redispatch_lost_jobs(settings=settings, now=later()) == [job]  # type: ignore[arg-type]
    assert queued_ids(rds, q) == [job]


def test_concurrent_reapers_dispatch_once(settings: Settings, tmp_path: Path, rds) -> None:  # type: ignore[no-untyped-def]
    url, q = settings.resolved_database_url, settings.default_queue
    data = sums_file(tmp_path / "d.jsonl")
    old = utcnow() - timedelta(seconds=GRACE + 5)  # real time here: a fresh stamp must read as fresh
    never, lost = make_job(url, data, queue=q, created_at=old), make_job(url, data, queue=q)
    dispatch_job(url, lost, q)
    age_dispatch(url, lost)
    rds.delete(q)
    start = threading.Barrier(4)
    results: list[list[str]] = []

    def reaper() -> None:
        start.wait()
        results.append(redispatch_lost_jobs(settings=settings))

    threads = [threading.Thread(target=reaper) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(j for r in results for j in r) == sorted([never, lost])
    assert sorted(queued_ids(rds, q)) == sorted([never, lost])
    assert events(url, never, NEVER_SENT_EVENT) == 1 and events(url, lost, LOST_EVENT) == 1


def test_requeue_paths_stamp_dispatched_at(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker.task as w
    from worker.reaper import reap_stale_jobs

    url = settings.resolved_database_url
    data = sums_file(tmp_path / "d.jsonl")
    old = utcnow() - timedelta(seconds=settings.heartbeat_timeout_seconds + 60)
    stale = make_job(
        url, data, status="running", worker_hostname="dead@h", heartbeat_at=old, attempts=1, dispatched_at=old
    )
    sent: list[str] = []
    assert reap_stale_jobs(settings=settings, enqueue=lambda j, q: sent.append(j)) == [stale] == sent
    assert (get_job(url, stale).dispatched_at or old) > old  # type: ignore[operator]

    monkeypatch.setattr(w, "enqueue_job", lambda j, queue=None: sent.append(j))
    job = make_job(url, data, queue=settings.default_queue)
    assert claim_job(job, "w1@h", settings) == "claimed"
    assert get_job(url, job).dispatched_at is None
    assert w.finish_after_exit(job, -9, "w1@h", settings) == "requeued" and sent[-1] == job
    assert get_job(url, job).status == "queued" and get_job(url, job).dispatched_at is not None


def test_failed_enqueue_leaves_the_job_for_the_next_round(settings: Settings, tmp_path: Path, rds) -> None:  # type: ignore[no-untyped-def]
    url, q = settings.resolved_database_url, settings.default_queue
    job = make_job(url, sums_file(tmp_path / "d.jsonl"), queue=q)

    def down(_j: str, _q: str) -> None:
        raise ConnectionError("broker down (test)")

    with pytest.raises(ConnectionError):
        redispatch_lost_jobs(settings=settings, now=later(), enqueue=down)  # type: ignore[arg-type]
    assert get_job(url, job).dispatched_at is None and events(url, job, NEVER_SENT_EVENT) == 0
    assert redispatch_lost_jobs(settings=settings, now=later()) == [job]  # type: ignore[arg-type]


def test_embedded_sqlite_and_kombu_sqlalchemy_broker(tmp_path: Path) -> None:
    """The embedded defaults: the SQLAlchemy transport counts its messages too."""
    from worker.broker import configure_celery

    settings = Settings(_env_file=None, data_dir=tmp_path / "var", dispatch_grace_seconds=GRACE)  # type: ignore[call-arg]
    assert settings.embedded and settings.resolved_broker_url.startswith("sqla+sqlite:")
    url, q = settings.resolved_database_url, settings.default_queue
    Base.metadata.create_all(get_engine(url))
    configure_celery(settings)
    broker = create_engine(settings.resolved_broker_url.removeprefix("sqla+"))
    try:
        data = sums_file(tmp_path / "d.jsonl")
        never, lost = make_job(url, data, queue=q), make_job(url, data, queue=q)
        dispatch_job(url, lost, q)
        age_dispatch(url, lost)
        assert broker_message_counts([q]) == {q: 1}
        assert redispatch_lost_jobs(settings=settings, now=later()) == [never]  # type: ignore[arg-type]
        assert broker_message_counts([q]) == {q: 2}
        with broker.begin() as conn:
            conn.execute(text("DELETE FROM kombu_message"))  # the broker lost everything
        assert sorted(redispatch_lost_jobs(settings=settings, now=later())) == sorted([never, lost])  # type: ignore[arg-type]
        assert broker_message_counts([q]) == {q: 2}
        assert redispatch_lost_jobs(settings=settings, now=later()) == []  # type: ignore[arg-type]
    finally:
        broker.dispose()
        configure_celery()
        get_engine(url).dispose()

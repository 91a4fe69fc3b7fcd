"""Make sure every queued job has a message in the broker (a transactional outbox, the database first).

The database is the source of truth; the broker message only wakes a worker. A queued job can be left
without one: the API commits the job and dies before its enqueue, or the broker loses messages (Redis
restarted without persistence, flushed; a worker killed between taking a message and recording it).
``FineTuningJob.dispatched_at`` is stamped once the broker has accepted the job's message, and cleared
whenever a job becomes queued (``store.jobs.set_status``). :func:`redispatch_lost_jobs`, run by the
reaper thread of every worker each round, then

1. dispatches queued jobs with no ``dispatched_at`` that were created (or re-queued) longer than
   ``dispatch_grace_seconds`` ago; a job re-queued to wait off the GPU (a full disk,
   :mod:`worker.requeue`: its ``not_before``) gets its message here at the first round after its
   wait is over (``HOLD_OVER_EVENT``; ``not_before`` cleared), never before;
2. per queue, counts the messages the broker holds (ready ones: a message a worker has taken but not
   acknowledged is not counted) and compares with the queued jobs that have been dispatched; when the
   broker holds fewer, messages were lost, and each of those jobs dispatched more than the grace ago
   is dispatched again (which of them lost theirs cannot be told; a duplicate is harmless, since
   ``store.jobs.claim`` runs a job only while it is queued). The broker is counted before the
   database is read, so a message taken and claimed in between is never mistaken for a lost one;
   only a message taken but not yet claimed at that very moment can be, and costs a duplicate.

Each job is re-checked under its row lock (``SKIP LOCKED``: a job a worker is claiming or another
reaper is dispatching is left alone) and stamped in the same transaction, so concurrent reapers on
several workers dispatch it once. Counting works on Redis and on kombu's SQLAlchemy transport (the
embedded default); a transport that cannot count skips step 2. A message for a job that is no longer
queued (cancelled while waiting, a duplicate) still counts, so it can hide one lost message until a
worker has consumed it. Does not import torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta

from sqlalchemy import and_, or_, select

from store.db import session_scope
from store.jobs import add_event, held_back, mark_dispatched
from store.orm import FineTuningJob, JobStatus, as_utc, utcnow
from store.settings import Settings, get_settings
from worker.broker import Enqueue, celery_app, enqueue_job

log = logging.getLogger("zenflow.dispatch")

#: Messages waiting in each of the given queues; None for a queue the broker cannot count.
CountMessages = Callable[[list[str]], dict[str, int | None]]

NEVER_SENT_EVENT = "Job was never handed to the broker; dispatched now"
HOLD_OVER_EVENT = "Wait over; dispatched to the workers of its queue"
LOST_EVENT = "Broker message lost; re-queued"


def _default_enqueue(job_id: str, queue: str) -> object:
    return enqueue_job(job_id, queue=queue)


def dispatch_job(url: str, job_id: str, queue: str, *, enqueue: Enqueue | None = None) -> None:
    """Send a committed, queued job's message, then stamp ``dispatched_at`` (re-queue paths)."""
    (enqueue or _default_enqueue)(job_id, queue)
    with session_scope(url) as s:
        mark_dispatched(s, job_id)


def broker_message_counts(queues: Iterable[str]) -> dict[str, int | None]:
    """Ready messages in each queue on ``celery_app``'s broker (None: cannot tell).

    Declares each queue as Celery's own consumers and producers do (idempotent), which answers with
    its message count. A broker that cannot be reached gives None for every queue.
    """
    queues = list(queues)
    counts: dict[str, int | None] = dict.fromkeys(queues)
    try:
        with celery_app.pool.acquire(block=True, timeout=30) as conn:
            conn.ensure_connection(max_retries=2)  # not default_channel's retry-forever
            channel = conn.default_channel
            for q in queues:
                try:
                    ok = celery_app.amqp.queues[q].bind(channel).queue_declare()
                except Exception:
                    log.warning(
                        "cannot count the messages of queue %s (%s)", q, conn.transport_cls, exc_info=True
                    )
                    continue
                n = getattr(ok, "message_count", None)
                counts[q] = n if isinstance(n, int) and not isinstance(n, bool) else None
    except Exception:
        log.warning("cannot reach the broker to count its messages", exc_info=True)
    return counts


def _dispatch_locked(
    url: str,
    job_id: str,
    due: Callable[[FineTuningJob], bool],
    enqueue: Enqueue,
    event: str,
    *,
    level: str = "warning",
) -> bool:
    """Under the job's row lock: if it is still queued and ``due``, enqueue it, stamp it (``not_before``
    cleared), log ``event``."""
    with session_scope(url) as s:
        job = s.execute(
            select(FineTuningJob).where(FineTuningJob.id == job_id).with_for_update(skip_locked=True)
        ).scalar_one_or_none()
        if job is None or job.status != JobStatus.queued.value or not due(job):
            return False
        enqueue(job.id, job.queue)
        job.dispatched_at, job.not_before = utcnow(), None
        add_event(s, job.id, event, level=level, data={"status": job.status, "queue": job.queue})
    return True


def dispatch_undispatched_jobs(
    *, settings: Settings | None = None, now: datetime | None = None, enqueue: Enqueue | None = None
) -> list[str]:
    """Step 1: queued jobs never handed to the broker, older than the grace, and those whose wait
    (``not_before``) is over; the ids dispatched."""
    settings = settings or get_settings()
    url, enqueue = settings.resolved_database_url, enqueue or _default_enqueue
    now = now or utcnow()
    cutoff = now - timedelta(seconds=settings.dispatch_grace_seconds)
    with session_scope(url) as s:
        rows = s.execute(
            select(FineTuningJob.id, FineTuningJob.not_before)
            .where(
                FineTuningJob.status == JobStatus.queued.value,
                FineTuningJob.dispatched_at.is_(None),
                or_(
                    and_(FineTuningJob.not_before.is_(None), FineTuningJob.created_at < cutoff),
                    FineTuningJob.not_before <= now,  # no one else sends it: no grace to give
                ),
            )
            .order_by(FineTuningJob.created_at)
        ).all()

    def due(job: FineTuningJob) -> bool:
        return job.dispatched_at is None and not held_back(job, now)

    sent: list[str] = []
    for job_id, not_before in rows:
        if not_before is not None:  # its wait off the GPU is over
            if _dispatch_locked(url, job_id, due, enqueue, HOLD_OVER_EVENT, level="info"):
                sent.append(job_id)
                log.info("dispatched job %s: its wait is over", job_id)
        elif _dispatch_locked(url, job_id, due, enqueue, NEVER_SENT_EVENT):
            sent.append(job_id)
            log.warning("dispatched job %s: it was queued without a broker message", job_id)
    return sent


def redispatch_lost_messages(
    *,
    settings: Settings | None = None,
    now: datetime | None = None,
    enqueue: Enqueue | None = None,
    count_messages: CountMessages | None = None,
) -> list[str]:
    """Step 2: where a queue's broker holds fewer messages than its dispatched queued jobs, dispatch
    those dispatched more than the grace ago again; the ids re-dispatched."""
    settings = settings or get_settings()
    url, enqueue = settings.resolved_database_url, enqueue or _default_enqueue
    cutoff = (now or utcnow()) - timedelta(seconds=settings.dispatch_grace_seconds)
    waiting = (FineTuningJob.status == JobStatus.queued.value) & FineTuningJob.dispatched_at.is_not(None)
    with session_scope(url) as s:
        queues = list(
            s.scalars(
                select(FineTuningJob.queue).where(waiting, FineTuningJob.dispatched_at < cutoff).distinct()
            )
        )
    if not queues:
        return []
    held = (count_messages or broker_message_counts)(queues)  # before reading the jobs: see the module doc

    def due(job: FineTuningJob) -> bool:  # still as dispatched as when counted (no other reaper re-sent it)
        at = as_utc(job.dispatched_at)
        return at is not None and at < cutoff

    resent: list[str] = []
    for q in queues:
        n = held.get(q)
        if n is None:
            continue
        with session_scope(url) as s:
            rows = s.execute(
                select(FineTuningJob.id, FineTuningJob.dispatched_at)
                .where(waiting, FineTuningJob.queue == q)
                .order_by(FineTuningJob.created_at)
            ).all()
        if n >= len(rows):
            continue
        suspects = [r.id for r in rows if (as_utc(r.dispatched_at) or cutoff) < cutoff]
        log.warning(
            "queue %s: the broker holds %d messages for %d dispatched queued jobs; re-dispatching %d",
            q,
            n,
            len(rows),
            len(suspects),
        )
        resent += [j for j in suspects if _dispatch_locked(url, j, due, enqueue, LOST_EVENT)]
    return resent


def redispatch_lost_jobs(
    *,
    settings: Settings | None = None,
    now: datetime | None = None,
    enqueue: Enqueue | None = None,
    count_messages: CountMessages | None = None,
) -> list[str]:
    """One reconcile round (steps 1 and 2); the ids of the jobs (re-)dispatched."""
    sent = dispatch_undispatched_jobs(settings=settings, now=now, enqueue=enqueue)
    return sent + redispatch_lost_messages(
        settings=settings, now=now, enqueue=enqueue, count_messages=count_messages
    )

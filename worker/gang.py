"""A worker's side of a multi-node job's gang (store.gang): claim by message, recruit, wait, settle.

Messages: each queued job has one message on its queue, as for single-node jobs. The worker whose
message claims a multi-node job by fair share takes node 0 of its gang and sends M-1 ``join`` messages
to the same queue (:func:`worker.broker.enqueue_gang_join`); a worker taking a ``join`` message joins
that gang if it is still forming, else does nothing. A worker whose job message finds a gang forming
on its queue joins it first and sends the message back (it was not spent on its job). A gang that does
not form is dissolved and its job's message sent again, so the broker still holds one job message per
queued job that is not forming (worker.dispatch), plus the join messages of forming gangs.
"""

from __future__ import annotations

import logging
import socket
import time

from store import gang, jobs
from store.db import session_scope
from store.gang import Member
from store.orm import FineTuningJob, JobStatus
from store.settings import Settings
from worker.broker import enqueue_gang_join, enqueue_job
from worker.dispatch import dispatch_job
from worker.requeue import settle_after_exit

log = logging.getLogger("zenflow.worker")

#: How often a waiting member looks at its gang (and beats its slot).
WAIT_POLL_SECONDS = 0.5


def free_endpoint(settings: Settings) -> str:
    """``host:port`` for a rendezvous this worker would host as node 0: its address and a port free now
    (released before the agent binds it: another process could take it meanwhile, the gang then fails
    to form and forms again)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"{settings.worker_address or socket.gethostname()}:{port}"


def claim(message_job_id: str, hostname: str, settings: Settings, queue: str | None) -> jobs.NextClaim:
    """store.gang.next_gang for a job message, then what it asks of the broker: the message back when it
    joined another job's gang, the join messages when it opened one."""
    with session_scope(settings.resolved_database_url) as s:
        result, member = gang.next_gang(
            s,
            hostname,
            settings,
            queue=queue,
            endpoint=free_endpoint(settings),
            message_job_id=message_job_id,
        )
    if result.outcome is jobs.Claim.joined and result.queue:
        enqueue_job(message_job_id, queue=result.queue)
    if result.outcome is jobs.Claim.forming and member is not None and result.queue:
        for _ in range(member.nodes - 1):
            enqueue_gang_join(member.job_id, result.queue)
    return result


def join(job_id: str, hostname: str, settings: Settings) -> Member | None:
    """For a ``join`` message: a slot in the job's forming gang, None when there is none to join."""
    with session_scope(settings.resolved_database_url) as s:
        job = jobs.lock_job(s, job_id)
        return None if job is None else gang.join(s, job, hostname, settings, endpoint=None)


def wait_formed(job_id: str, hostname: str, settings: Settings) -> Member | None:
    """Beat this worker's slot until its gang starts (the member, started) or is dissolved (None). Gives
    up ``gang_form_timeout_seconds`` after it began waiting: it dissolves the gang then (whoever is first
    past the deadline does; a member that died is dissolved by the reaper) and sends the job's message
    again, the job keeping its place."""
    url = settings.resolved_database_url
    deadline = time.monotonic() + settings.gang_form_timeout_seconds
    while True:
        with session_scope(url) as s:
            member = gang.view(s, job_id, hostname)
            if member is not None:
                gang.beat(s, member, hostname)
        if member is None or member.started:
            return member
        if time.monotonic() >= deadline:
            break
        time.sleep(WAIT_POLL_SECONDS)
    why = f"its gang did not form within {settings.gang_form_timeout_seconds:g} s"
    with session_scope(url) as s:
        gang.leave(s, member, why)
        job = s.get(FineTuningJob, job_id)
        queue = job.queue if job is not None and job.status == JobStatus.queued.value else None
    if queue is not None:
        dispatch_job(url, job_id, queue, enqueue=lambda j, q: enqueue_job(j, queue=q))
    log.info("job %s: %s; released", job_id, why)
    return None


def beat(member: Member, hostname: str, node0: str, settings: Settings) -> None:
    """A running member's heartbeat: its slot's, and node 0's also the job's (store.jobs.beat)."""
    with session_scope(settings.resolved_database_url) as s:
        gang.beat(s, member, hostname)
        if member.node_rank == 0:
            jobs.beat(s, member.job_id, node0)


def node0_hostname(job_id: str, settings: Settings) -> str:
    """The worker the job is claimed for (node 0): the runner of global rank 0 acts under its name."""
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(FineTuningJob, job_id)
        return job.worker_hostname or "" if job is not None else ""


def settle(member: Member, rc: int, hostname: str, node0: str, settings: Settings, *, preempted: bool) -> str:
    """After this node's ranks ended: a node whose ranks failed settles the job for the gang (re-queued
    to resume from its last complete checkpoint on any nodes, the attempt counted, or failed with none
    left), whichever node it is, while the job still runs this attempt; an exit 0 of a node other than
    0 settles nothing (node 0's global rank 0 writes the end state). Node 0 settles as a single-node
    worker does (worker.requeue)."""
    if member.node_rank != 0 and rc == 0:
        with session_scope(settings.resolved_database_url) as s:
            gang.done(s, member, hostname)
        return "done"
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(FineTuningJob, member.job_id)
        current = job is not None and job.status == JobStatus.running.value and job.attempts == member.attempt
    if not current and member.node_rank != 0:
        return "not-ours"
    return settle_after_exit(
        member.job_id, rc, node0, settings, preempted=preempted, enqueue=lambda j, q: enqueue_job(j, queue=q)
    )

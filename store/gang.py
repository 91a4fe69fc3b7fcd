"""Gang scheduling through the database: one job on ``resources.nodes`` M worker hosts at once.

A job for M > 1 nodes is run by M workers together, each holding a node slot
(:class:`~store.orm.JobNode`) of the job's next attempt:

- the worker that takes the job's message by fair share (:func:`next_gang`, through
  :func:`store.jobs.claim_next`) takes node 0 and records the rendezvous endpoint (its host and a free
  port); the job stays ``queued`` meanwhile (no attempt counted, no run in the ledger, no GPUs held in
  the GPU-hour quota) and the worker recruits the others (``join`` messages, worker side);
- other workers of the same size join it (:func:`join`), forming gangs first, oldest job first;
- the member taking the last slot starts the attempt in the same transaction: :func:`store.jobs.claim`
  on node 0's hostname, the attempt counted, one run of M x ``gpus`` GPUs opened. Every member sees the
  job ``running`` at its attempt (:func:`view`) and starts its ranks with the same rendezvous id;
- a gang not formed ``gang_form_timeout_seconds`` after node 0 joined, or one of whose waiting members
  stopped beating its slot (:func:`beat`) for ``heartbeat_timeout_seconds``, is dissolved
  (:func:`dissolve`): its slots are deleted, the job stays ``queued`` with its ``created_at`` (its
  fair-share position) and its attempts, and its message is sent again (``dispatched_at`` cleared:
  worker.dispatch re-sends it). A partial gang never holds workers past the deadline, so two large
  jobs cannot deadlock each other;
- a running gang whose member's slot goes stale is lost (:func:`lost_running`): the caller re-queues it
  (store.jobs.requeue), the attempt counted, to resume from its last complete checkpoint on any M nodes.

Every function runs under the caller's transaction; the job row lock (:func:`store.jobs.lock_job`, or
``SKIP LOCKED`` in the claim) serializes the members of one gang.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from store import jobs
from store.orm import FineTuningJob, JobNode, JobStatus, as_utc, utcnow
from store.settings import Settings


@dataclass(frozen=True)
class Member:
    """A worker's place in a gang: what it needs to start its ranks once the gang is ``started``."""

    job_id: str
    attempt: int
    node_rank: int
    nodes: int
    #: node 0's ``host:port``: the rendezvous every member's agent joins.
    rdzv_endpoint: str
    #: All slots taken and the job running at this attempt.
    started: bool

    @property
    def run_id(self) -> str:
        """The rendezvous id of this attempt: a member of an earlier attempt cannot join it."""
        return f"{self.job_id}-a{self.attempt}"


def slots(session: Session, job_id: str, attempt: int) -> list[JobNode]:
    """The attempt's slots by node rank."""
    return list(
        session.scalars(
            select(JobNode)
            .where(JobNode.job_id == job_id, JobNode.attempt == attempt)
            .order_by(JobNode.node_rank)
        )
    )


def _member(job: FineTuningJob, rows: list[JobNode], hostname: str) -> Member | None:
    mine = next((r for r in rows if r.worker_hostname == hostname), None)
    if mine is None or not rows or rows[0].node_rank != 0:
        return None
    attempt = mine.attempt
    started = job.status == JobStatus.running.value and job.attempts == attempt
    return Member(
        job.id, attempt, mine.node_rank, job.request.resources.nodes, rows[0].rdzv_endpoint or "", started
    )


def view(session: Session, job_id: str, hostname: str) -> Member | None:
    """Where ``hostname`` stands in the job's newest gang: None when it holds no slot there (dissolved,
    or never joined)."""
    job = session.get(FineTuningJob, job_id, populate_existing=True)
    if job is None:
        return None
    attempt = session.scalar(select(func.max(JobNode.attempt)).where(JobNode.job_id == job_id))
    if attempt is None:
        return None
    return _member(job, slots(session, job_id, int(attempt)), hostname)


def _expired(rows: list[JobNode], settings: Settings, now: datetime) -> str | None:
    """Why a forming gang must be dissolved now, or None."""
    if not rows:
        return None
    started = as_utc(rows[0].joined_at) or now
    if now - started >= timedelta(seconds=settings.gang_form_timeout_seconds):
        return f"its gang did not form within {settings.gang_form_timeout_seconds:g} s"
    stale = timedelta(seconds=settings.heartbeat_timeout_seconds)
    for r in rows:
        if now - (as_utc(r.heartbeat_at) or now) >= stale:
            return f"node {r.node_rank} ({r.worker_hostname}) of its gang stopped beating"
    return None


def dissolve(session: Session, job: FineTuningJob, attempt: int, why: str) -> None:
    """Release a forming gang's slots: the job (still ``queued``) waits its turn again with its position
    and its attempts, and its message is sent again (worker.dispatch sends one for ``dispatched_at``
    NULL)."""
    session.execute(delete(JobNode).where(JobNode.job_id == job.id, JobNode.attempt == attempt))
    if job.status == JobStatus.queued.value:
        job.dispatched_at = None
    jobs.add_event(
        session,
        job.id,
        f"Gang released: {why}; the job waits for {job.request.resources.nodes} workers again",
        level="warning",
        data={"gang": "released", "attempt": attempt},
    )


def join(
    session: Session,
    job: FineTuningJob,
    hostname: str,
    settings: Settings,
    *,
    endpoint: str | None,
    now: datetime | None = None,
) -> Member | None:
    """Take a node slot of ``job``'s next attempt for ``hostname`` (the caller holds the job row lock).

    None when the job cannot be joined: not queued, not multi-node, held back or cancel requested, its
    gang full, or no gang forming and no ``endpoint`` to open one with. A gang past its deadline (or
    with a stale member) is dissolved first. A worker already in the gang gets its slot back. The member
    taking the last slot starts the attempt (:func:`store.jobs.claim` on node 0's hostname, the run
    holding every node's GPUs); a claim that cancels or fails the job instead releases the slots.
    """
    now = now or utcnow()
    nodes = job.request.resources.nodes
    if job.status != JobStatus.queued.value or nodes < 2 or job.cancel_requested or jobs.held_back(job, now):
        return None
    attempt = job.attempts + 1
    rows = slots(session, job.id, attempt)
    why = _expired(rows, settings, now)
    if why:
        dissolve(session, job, attempt, why)
        rows = []
    mine = _member(job, rows, hostname)
    if mine is not None:
        return mine
    if len(rows) >= nodes or (not rows and not endpoint):
        return None
    session.add(
        JobNode(
            job_id=job.id,
            attempt=attempt,
            node_rank=len(rows),
            worker_hostname=hostname,
            rdzv_endpoint=None if rows else endpoint,
            joined_at=now,
            heartbeat_at=now,
        )
    )
    session.flush()
    rows = slots(session, job.id, attempt)
    if len(rows) == nodes:
        outcome = jobs.claim(
            session,
            job,
            rows[0].worker_hostname,
            max_attempts=settings.max_job_attempts,
            heartbeat_timeout_seconds=settings.heartbeat_timeout_seconds,
            gpus=job.world_size,
        )
        if outcome is not jobs.Claim.claimed:
            session.execute(delete(JobNode).where(JobNode.job_id == job.id, JobNode.attempt == attempt))
            return None
        jobs.add_event(
            session,
            job.id,
            f"Gang of {nodes} nodes formed: " + ", ".join(r.worker_hostname for r in rows),
            data={"gang": "formed", "attempt": attempt, "nodes": [r.worker_hostname for r in rows]},
        )
    return _member(job, rows, hostname)


def forming(session: Session, queue: str) -> list[str]:
    """Queued jobs of ``queue`` whose gang for their next attempt is forming, oldest job first."""
    return list(
        session.scalars(
            select(FineTuningJob.id)
            .join(JobNode, JobNode.job_id == FineTuningJob.id)
            .where(
                FineTuningJob.queue == queue,
                FineTuningJob.status == JobStatus.queued.value,
                JobNode.attempt == FineTuningJob.attempts + 1,
            )
            .group_by(FineTuningJob.id, FineTuningJob.created_at)
            .order_by(FineTuningJob.created_at, FineTuningJob.id)
        )
    )


def next_gang(
    session: Session,
    hostname: str,
    settings: Settings,
    *,
    queue: str | None,
    endpoint: str,
    message_job_id: str | None = None,
    now: datetime | None = None,
) -> tuple[jobs.NextClaim, Member | None]:
    """A worker that may serve multi-node jobs took a job message from ``queue``: join the oldest
    forming gang there (``joined``: the message was not spent on its job, the caller sends it back),
    else claim by fair share (:func:`store.jobs.claim_next`), a single-node job as before, a multi-node
    one by opening its gang as node 0 (``forming``: the caller recruits its other nodes). Jobs whose
    gang is forming are passed over by the fair-share pass (their members are recruited, not claimed).
    A message whose own job is a dead multi-node run re-queues it first (the attempt counted): a gang is
    never taken over by one node.
    """
    now = now or utcnow()
    own = session.get(FineTuningJob, message_job_id) if message_job_id else None
    if own is not None:
        queue = own.queue
        own = _unless_running_gang(session, own, settings, now)
    if queue is None:
        return jobs.NextClaim(jobs.Claim.missing), None
    joined = _join_forming(session, queue, hostname, settings, now)
    if joined is not None:
        return joined
    take = _Take(session, hostname, settings, endpoint=endpoint, now=now)
    result = jobs.claim_next(
        session, hostname, settings, message_job_id=own.id if own else None, queue=queue, take=take
    )
    return result, (take.opened[0] if take.opened else None)


def _unless_running_gang(
    session: Session, own: FineTuningJob, settings: Settings, now: datetime
) -> FineTuningJob | None:
    """The message's own job, or None when it is a running multi-node job (re-queued first, the attempt
    counted, when its heartbeat is stale: a gang is never taken over by one node)."""
    if own.request.resources.nodes > 1 and own.status == JobStatus.running.value:
        locked = jobs.lock_job(session, own.id)
        if locked is not None and not jobs.heartbeat_is_fresh(
            locked.heartbeat_at, settings.heartbeat_timeout_seconds, now
        ):
            jobs.requeue(session, locked, "A node of its gang was lost")
        return None
    return own


def _join_forming(
    session: Session, queue: str, hostname: str, settings: Settings, now: datetime
) -> tuple[jobs.NextClaim, Member] | None:
    """Join the oldest gang forming on ``queue`` that has room (None: none had)."""
    for job_id in forming(session, queue):
        job = session.execute(
            select(FineTuningJob)
            .where(FineTuningJob.id == job_id)
            .with_for_update(skip_locked=True)
            .execution_options(populate_existing=True)
        ).scalar_one_or_none()
        if job is None:
            continue
        member = join(session, job, hostname, settings, endpoint=None, now=now)
        if member is not None:
            return jobs.NextClaim(jobs.Claim.joined, job.id, queue), member
    return None


class _Take:
    """The fair-share pass's ``take``: a single-node job claimed as before, a multi-node one's gang
    opened as node 0 (its member kept in ``opened``), a forming one passed over."""

    def __init__(
        self, session: Session, hostname: str, settings: Settings, *, endpoint: str, now: datetime
    ) -> None:
        self.session, self.hostname, self.settings = session, hostname, settings
        self.endpoint, self.now = endpoint, now
        self.opened: list[Member] = []

    def __call__(self, job: FineTuningJob) -> jobs.Claim:
        session, settings = self.session, self.settings
        if job.request.resources.nodes < 2:
            return jobs.claim(
                session,
                job,
                self.hostname,
                max_attempts=settings.max_job_attempts,
                heartbeat_timeout_seconds=settings.heartbeat_timeout_seconds,
            )
        rows = slots(session, job.id, job.attempts + 1)
        if rows and not _expired(rows, settings, self.now):
            return jobs.Claim.running_elsewhere  # forming: recruited through join, not claimed again
        member = join(session, job, self.hostname, settings, endpoint=self.endpoint, now=self.now)
        if member is None:
            return jobs.Claim.running_elsewhere
        self.opened.append(member)
        return jobs.Claim.forming


def beat(session: Session, member: Member, hostname: str, *, now: datetime | None = None) -> bool:
    """Refresh ``hostname``'s slot heartbeat; False when the slot is gone (its gang was dissolved)."""
    res = session.execute(
        update(JobNode)
        .where(
            JobNode.job_id == member.job_id,
            JobNode.attempt == member.attempt,
            JobNode.worker_hostname == hostname,
        )
        .values(heartbeat_at=now or utcnow())
    )
    return bool(getattr(res, "rowcount", 0))


def done(session: Session, member: Member, hostname: str, *, now: datetime | None = None) -> None:
    """A member whose ranks ended cleanly stops beating: its slot no longer counts as lost while node 0
    writes the job's end state."""
    session.execute(
        update(JobNode)
        .where(
            JobNode.job_id == member.job_id,
            JobNode.attempt == member.attempt,
            JobNode.worker_hostname == hostname,
        )
        .values(left_at=now or utcnow())
    )


def leave(session: Session, member: Member, why: str) -> None:
    """A member gives up waiting (its deadline passed, or it is stopping): a gang still forming is
    dissolved for all its members (a partial gang must not stay); a started one is left to the run."""
    job = jobs.lock_job(session, member.job_id)
    if job is None or job.status != JobStatus.queued.value:
        return
    if slots(session, job.id, member.attempt):
        dissolve(session, job, member.attempt, why)


def expire_forming(session: Session, settings: Settings, *, now: datetime | None = None) -> list[str]:
    """Dissolve every forming gang past its deadline or with a stale member (the reaper: members that
    died while waiting release nothing themselves); the jobs released."""
    now = now or utcnow()
    released = []
    ids = session.scalars(
        select(JobNode.job_id)
        .join(FineTuningJob, JobNode.job_id == FineTuningJob.id)
        .where(FineTuningJob.status == JobStatus.queued.value, JobNode.attempt == FineTuningJob.attempts + 1)
        .distinct()
    ).all()
    for job_id in ids:
        job = session.execute(
            select(FineTuningJob).where(FineTuningJob.id == job_id).with_for_update(skip_locked=True)
        ).scalar_one_or_none()
        if job is None or job.status != JobStatus.queued.value:
            continue
        why = _expired(slots(session, job.id, job.attempts + 1), settings, now)
        if why:
            dissolve(session, job, job.attempts + 1, why)
            released.append(job.id)
    return released


def lost_running(session: Session, settings: Settings, *, now: datetime | None = None) -> list[str]:
    """Running multi-node jobs one of whose current attempt's slots has a stale heartbeat (a node lost
    mid-job): the caller re-queues each (the whole gang stops, store.jobs.requeue)."""
    now = now or utcnow()
    cutoff = now - timedelta(seconds=settings.heartbeat_timeout_seconds)
    return list(
        session.scalars(
            select(FineTuningJob.id)
            .join(JobNode, JobNode.job_id == FineTuningJob.id)
            .where(
                FineTuningJob.status == JobStatus.running.value,
                JobNode.attempt == FineTuningJob.attempts,
                JobNode.heartbeat_at < cutoff,
                JobNode.left_at.is_(None),
            )
            .distinct()
        )
    )

"""Job state and its transitions, shared by the API (create, cancel) and the worker service (claim,
run, re-queue, finish).

Every move of a job between states goes through one named function here, each under the caller's
transaction (and, where several writers race, the row lock of :func:`lock_job`):

==================  =========================================  ==================================
function            from -> to                                 callers
==================  =========================================  ==================================
:func:`claim_next`  the queue's next job by fair share         the worker task
                    (or the message's dead run) -> running
:func:`claim`       queued (or a dead run) -> running          claim_next, a runner by hand
:func:`requeue`     running -> queued (resume from checkpoint)  the worker task, the reaper
:func:`fail`        any -> failed, with an error object        worker, reaper, job runner
:func:`succeed`     running -> succeeded                       the job runner
:func:`cancel`      any -> cancelled                           API, worker, reaper, job runner
:func:`pause`       waiting or running -> paused               API, job runner, worker, reaper
request_pause       waiting -> paused; running: pause_requested  API
:func:`resume`      paused -> queued (its place kept)          API
==================  =========================================  ==================================

A user's pause and resume (``POST /v1/fine_tuning/jobs/{id}/pause`` and ``/resume``): a paused job
(``JobStatus.paused``, not terminal) is off the queue and off the GPUs: no worker claims it
(:func:`claim`), the dispatcher and the reaper leave it alone (they look at queued and running jobs),
fair share does not rank it and the quotas count it neither as running nor as waiting. It keeps
everything it needs to go on: its row (request, resolutions, ``created_at``, attempts), its output
directory with its checkpoints, its files. :func:`request_pause` pauses a waiting job at once; a
running one gets ``pause_requested`` and an event, and its runner, which polls the flag
(worker.job.monitor), stops at its next step as a cancel does (checkpointing there) and writes
``paused`` ("Job paused at step N"), its run ended in the ledger; a run that ends otherwise while the
pause is pending (its process killed, its worker lost) is paused rather than re-queued. :func:`resume`
puts a paused job back in its queue as the same job (the caller admits it by its team's quotas first,
as a create, and sends it after the commit); it keeps its ``created_at``, by which fair share orders a
team's waiting jobs (store.fairshare), and its next run resumes from the checkpoint it paused at, with
its current resolution while the worker's machine is the one it was resolved for. A cancel of a paused
job cancels it at once (:func:`request_cancel`).

:func:`set_status` is the one primitive under them all (timestamps, ``dispatched_at``, the event,
and the run ledger: a job leaving ``running`` ends its run, see store.runs).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

from store import quotas
from store.fairshare import WAITING, fair_order
from store.orm import FineTuningJob, JobCheckpoint, JobEvent, JobNode, JobStatus, as_utc, utcnow
from store.runs import end_runs, open_run
from store.settings import Settings

#: Jobs waiting for a worker (they have a queue position).
PENDING = WAITING


def add_event(
    session: Session,
    job_id: str,
    message: str,
    *,
    level: str = "info",
    type: str = "message",
    data: dict[str, Any] | None = None,
) -> JobEvent:
    ev = JobEvent(job_id=job_id, message=message, level=level, type=type, data=data)
    session.add(ev)
    return ev


def job_error(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object a failed job carries: ``{code, message, param}``."""
    return {"code": code, "message": message, "param": param}


def set_status(
    session: Session,
    job: FineTuningJob,
    status: JobStatus,
    *,
    message: str | None = None,
    error: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
) -> None:
    """Move a job to ``status`` and record an event (its data: ``status`` and ``data``); terminal states
    stamp finished_at, queued clears dispatched_at (the new wait needs a message), leaving running ends
    the job's run (store.runs), paused and terminal states end a pending pause request."""
    if job.status == JobStatus.running.value:
        end_runs(session, job.id)
    job.status = status.value
    if status is JobStatus.paused or status.terminal:
        job.pause_requested = False
    if status is JobStatus.queued:
        job.dispatched_at = None  # a new wait in the queue: its message is still to be sent
    if status is JobStatus.running and job.started_at is None:
        job.started_at = utcnow()
    if status.terminal:
        job.finished_at = utcnow()
    if error is not None:
        job.error = error
    level = "error" if status is JobStatus.failed else "info"
    add_event(
        session,
        job.id,
        message or f"Job {status.value}",
        level=level,
        data={**(data or {}), "status": status.value},
    )


def lock_job(session: Session, job_id: str) -> FineTuningJob | None:
    """Load a job row for update (row lock on PostgreSQL; SQLite serializes writers anyway)."""
    return session.execute(
        select(FineTuningJob).where(FineTuningJob.id == job_id).with_for_update()
    ).scalar_one_or_none()


def mark_dispatched(session: Session, job_id: str) -> bool:
    """Record that the broker accepted the job's message (only while the job is still queued)."""
    res = session.execute(
        update(FineTuningJob)
        .where(FineTuningJob.id == job_id, FineTuningJob.status == JobStatus.queued.value)
        .values(dispatched_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    assert isinstance(res, CursorResult)
    return bool(res.rowcount)


def heartbeat_is_fresh(
    heartbeat_at: datetime | None, timeout_seconds: float, now: datetime | None = None
) -> bool:
    """Whether a run that last beat at ``heartbeat_at`` is still alive by the heartbeat timeout."""
    hb = as_utc(heartbeat_at)
    return hb is not None and (now or utcnow()) - hb < timedelta(seconds=timeout_seconds)


def beat(session: Session, job_id: str, hostname: str) -> None:
    """Refresh the heartbeat of a job ``hostname`` runs: never of one re-queued, finished or taken over
    meanwhile. Beaten by the job's runner (its monitor) and by the worker waiting on that runner."""
    session.execute(
        update(FineTuningJob)
        .where(
            FineTuningJob.id == job_id,
            FineTuningJob.worker_hostname == hostname,
            FineTuningJob.status == JobStatus.running.value,
        )
        .values(heartbeat_at=utcnow())
    )


# --- transitions -------------------------------------------------------------------------------------


class Claim(enum.StrEnum):
    """What :func:`claim` decided."""

    claimed = "claimed"
    missing = "missing"
    terminal = "terminal"
    running_elsewhere = "running-elsewhere"
    cancelled = "cancelled"
    failed = "failed"
    #: The job is paused (a paused job is never claimed), or was paused now: its pause was pending.
    paused = "paused"
    #: claim_next: only jobs of teams at their max_running_jobs or gpu_hours quota wait (or teams being
    #: claimed for), or jobs whose rows another transaction holds at the moment.
    held = "held"
    #: claim_next: no job waits on the queue.
    idle = "idle"
    #: store.gang: this worker took node 0 of a multi-node job's gang, which now forms (the job stays
    #: queued until all its nodes joined).
    forming = "forming"
    #: store.gang: this worker joined a forming gang as one of its other nodes.
    joined = "joined"


def claim(
    session: Session,
    job: FineTuningJob | None,
    hostname: str,
    *,
    max_attempts: int,
    heartbeat_timeout_seconds: float,
    gpus: int | None = None,
) -> Claim:
    """Decide, under the row lock, whether ``hostname`` runs ``job`` now, and mark it running if so.

    A terminal job is left alone; a job running on another node with a fresh heartbeat is left to it
    (a redelivered message never starts a second run); a job marked running by this same node is taken
    over (that run is dead: a node runs one job at a time); a paused job is left paused; a pending cancel
    cancels it, a pending pause pauses it; with ``max_attempts`` used up it fails; else the attempt is
    counted and the job runs here. The run opened in the ledger holds ``gpus`` GPUs (None: the ranks the
    job asks for, its ``resources.gpus``).
    """
    if job is None:
        return Claim.missing
    status = JobStatus(job.status)
    if status.terminal:
        return Claim.terminal
    if status is JobStatus.paused:
        return Claim.paused
    if (
        status is JobStatus.running
        and job.worker_hostname != hostname
        and heartbeat_is_fresh(job.heartbeat_at, heartbeat_timeout_seconds)
    ):
        return Claim.running_elsewhere
    if job.cancel_requested:
        cancel(session, job, "Job cancelled before it started")
        return Claim.cancelled
    if job.pause_requested:
        pause(session, job, "Job paused: its pause was pending when a worker took it")
        return Claim.paused
    if job.attempts >= max_attempts:
        fail(session, job, "max_attempts_exceeded", f"gave up after {job.attempts} attempts")
        return Claim.failed
    job.attempts += 1
    job.worker_hostname = hostname
    job.heartbeat_at = utcnow()
    if status is JobStatus.running:
        add_event(session, job.id, "Previous run of this job was lost; taking it over", level="warning")
    step = resume_step(session, job)
    resume = (
        ", resuming from its last checkpoint"
        if step is None
        else f", resuming from step {step}"
        if step
        else ", restarting from step 0 (no checkpoint yet)"
        if job.global_step
        else ""
    )
    set_status(
        session,
        job,
        JobStatus.running,
        message=f"Attempt {job.attempts}/{max_attempts} started on {hostname}{resume}",
    )
    open_run(session, job, hostname, gpus=job.world_size if gpus is None else gpus)
    return Claim.claimed


@dataclass(frozen=True)
class NextClaim:
    """What :func:`claim_next` decided, and the job: the one claimed (or cancelled, failed), or for
    ``held`` one of the jobs held back (the message goes back to the queue for it)."""

    outcome: Claim
    job_id: str | None = None
    #: The queue the claim looked at.
    queue: str | None = None


def claim_next(
    session: Session,
    hostname: str,
    settings: Settings,
    *,
    message_job_id: str | None,
    queue: str | None = None,
    gpus: int | None = None,
    take: Callable[[FineTuningJob], Claim] | None = None,
) -> NextClaim:
    """A worker took a message from ``queue``: claim the job fair share puts first (store.fairshare).

    Each queued job has one message, and each message claims one job, so the broker still holds as
    many messages as there are queued jobs (worker.dispatch counts on it); which message
    runs which job does not matter. The message's own job comes first only when it is a dead run to
    take over (running on this node, or with a stale heartbeat): that is what :func:`claim` would do.

    Each candidate is locked with ``SKIP LOCKED`` and re-checked; one whose row another transaction holds
    (another worker claiming it, the API cancelling it or stamping its dispatch) makes the outcome
    ``held`` when nothing else is claimed, so the message is retried rather than consumed; a team at its
    ``max_running_jobs`` quota is skipped under its own row lock (also ``SKIP LOCKED``), so racing claims
    never exceed it; a team at or over its ``gpu_hours`` quota (its running jobs counted so far) is
    skipped too, its waiting jobs on the queue told why once (:func:`_tell_held`). A candidate that turns
    out cancelled or out of attempts is settled and the next one tried. The queue is the message's job's,
    else ``queue``.

    ``take`` (default :func:`claim` here) decides for each locked candidate; store.gang passes one that
    opens a gang for a multi-node job (``forming``) and skips a gang already forming.
    """

    def run_here(job: FineTuningJob | None) -> Claim:
        return claim(
            session,
            job,
            hostname,
            max_attempts=settings.max_job_attempts,
            heartbeat_timeout_seconds=settings.heartbeat_timeout_seconds,
            gpus=gpus,
        )

    own = session.get(FineTuningJob, message_job_id) if message_job_id else None
    if own is not None:
        queue = own.queue
        taken = _take_over_dead_run(session, own, hostname, settings, run_here)
        if taken is not None:
            return taken
    if queue is None:
        return NextClaim(Claim.missing)
    return _claim_in_fair_order(session, queue, settings, take or run_here)


def _locked(session: Session, job_id: str, *, skip_locked: bool) -> FineTuningJob | None:
    """The job row under its lock, as it is under the lock (populate_existing: not as an earlier read left it)."""
    return session.execute(
        select(FineTuningJob)
        .where(FineTuningJob.id == job_id)
        .with_for_update(skip_locked=skip_locked)
        .execution_options(populate_existing=True)
    ).scalar_one_or_none()


def _take_over_dead_run(
    session: Session,
    own: FineTuningJob,
    hostname: str,
    settings: Settings,
    run_here: Callable[[FineTuningJob | None], Claim],
) -> NextClaim | None:
    """The message's own job when it is a dead run to take over (running on this node, or its heartbeat
    stale): claimed here, unless another worker took it over first (None: go on in fair order)."""
    dead = own.worker_hostname == hostname or not heartbeat_is_fresh(
        own.heartbeat_at, settings.heartbeat_timeout_seconds
    )
    if own.status != JobStatus.running.value or not dead:
        return None
    outcome = run_here(_locked(session, own.id, skip_locked=False))
    return None if outcome is Claim.running_elsewhere else NextClaim(outcome, own.id, own.queue)


def _claim_in_fair_order(
    session: Session, queue: str, settings: Settings, take: Callable[[FineTuningJob], Claim]
) -> NextClaim:
    """The first waiting job of ``queue`` by fair share whose team may start one now, taken by ``take``."""
    order = fair_order(queue)
    candidates = session.execute(select(order.c.job_id, order.c.team_id).order_by(order.c.pos)).all()
    held: str | None = None
    teams: dict[str, bool] = {}  # team -> may start a job now
    for job_id, team_id in candidates:
        if team_id not in teams:
            teams[team_id] = _team_may_start(
                session, team_id, [j for j, t in candidates if t == team_id], settings
            )
        if not teams[team_id]:
            held = held or job_id
            continue
        job = _locked(session, job_id, skip_locked=True)
        if job is None:  # its row is another transaction's now (a claim, a cancel, the API's dispatch
            held = held or job_id  # stamp): re-checked, never passed over with this message consumed
            continue
        if job.status not in PENDING or held_back(job):
            continue
        outcome = take(job)
        if outcome in (Claim.claimed, Claim.forming):
            return NextClaim(outcome, job.id, queue)
    return NextClaim(Claim.held, held, queue) if held else NextClaim(Claim.idle, None, queue)


def _team_may_start(session: Session, team_id: str, waiting: list[str], settings: Settings) -> bool:
    """Whether the team may start a job now: not at its ``gpu_hours`` quota (its ``waiting`` jobs told why
    once) nor at its ``max_running_jobs``."""
    gpu = quotas.gpu_hours_now(session, team_id, settings)
    if gpu is not None and gpu.reached:
        _tell_held(session, team_id, waiting, gpu, settings)
        return False
    return _may_start(session, team_id, settings)


def _may_start(session: Session, team_id: str, settings: Settings) -> bool:
    """Whether the team is below its max_running_jobs quota; a team with one is checked under its row
    lock, and one whose row another transaction holds (a create, another claim) is passed over now."""
    limit = quotas.limits_for(session, team_id, settings).max_running_jobs
    if limit is None:
        return True
    if not quotas.try_lock_team(session, team_id):
        return False
    return quotas.running_jobs(session, team_id) < limit


#: ``data["quota_hold"]`` of the event telling a waiting job that a quota holds it back.
QUOTA_HOLD = "quota_hold"


def _tell_held(
    session: Session, team_id: str, job_ids: list[str], gpu: quotas.GpuHours, settings: Settings
) -> None:
    """Tell each of ``job_ids`` (waiting jobs of a team at its GPU-hour quota) why it waits, once per
    wait: not a job told so since it last ran (its last ``running`` status event), whatever other events
    came since (a re-dispatch, a cancel request). Under the team's row lock, not waited for: a claim
    holding it (another worker's) tells them, or the next claim does."""
    if not job_ids or not quotas.try_lock_team(session, team_id):
        return
    ran = (
        select(JobEvent.job_id, func.max(JobEvent.seq).label("seq"))
        .where(JobEvent.job_id.in_(job_ids), JobEvent.data["status"].as_string() == JobStatus.running.value)
        .group_by(JobEvent.job_id)
        .subquery()
    )
    told = set(
        session.scalars(
            select(JobEvent.job_id)
            .outerjoin(ran, ran.c.job_id == JobEvent.job_id)
            .where(
                JobEvent.job_id.in_(job_ids),
                JobEvent.data[QUOTA_HOLD].as_string() == "gpu_hours",
                JobEvent.seq > func.coalesce(ran.c.seq, 0),
            )
        )
    )
    todo = [j for j in job_ids if j not in told]
    if not todo:
        return
    message = quotas.gpu_hold_message(session, team_id, gpu, settings)
    data = {
        QUOTA_HOLD: "gpu_hours",
        "limit_gpu_hours": gpu.limit_seconds / 3600,
        "used_gpu_hours": gpu.used_seconds / 3600,
    }
    for job_id in todo:
        add_event(session, job_id, message, level="warning", data=data)


def requeue(session: Session, job: FineTuningJob, why: str) -> str:
    """Put a running job back on its queue to resume from its last checkpoint; the queue to send it to.
    A job whose pause was pending is paused instead (a message sent for it then claims nothing for it).

    The caller sends the message after committing (``worker.dispatch.dispatch_job``).
    """
    if job.pause_requested:
        pause(session, job, f"{why}; paused as requested, {resume_words(session, job)} when resumed")
        return job.queue
    job.worker_hostname = None
    job.heartbeat_at = None
    set_status(session, job, JobStatus.queued, message=f"{why}; re-queued {resume_words(session, job)}")
    return job.queue


def resume_words(session: Session, job: FineTuningJob) -> str:
    """Where the job's next run starts, in words: "to resume from step 60"."""
    step = resume_step(session, job)
    if step is None:
        return "to resume from its last checkpoint"
    return f"to resume from step {step}" if step else "to restart from step 0 (no checkpoint yet)"


def resume_step(session: Session, job: FineTuningJob) -> int | None:
    """The step the job's next run resumes from: its last checkpoint's (its row's step; for one whose
    row is not written yet, found on disk by the worker, the number its directory's name ends with), 0
    without a checkpoint, None when that cannot be told. Not ``global_step``: the steps run after the
    last checkpoint are run again."""
    path = job.last_checkpoint_path
    if not path:
        return 0
    step = session.scalar(
        select(JobCheckpoint.step_number).where(JobCheckpoint.job_id == job.id, JobCheckpoint.path == path)
    )
    if step is not None:
        return int(step)
    digits = re.search(r"(\d+)$", path.rstrip("/"))
    return int(digits.group(1)) if digits else None


def held_back(job: FineTuningJob, now: datetime | None = None) -> bool:
    """Whether a queued job must still wait before a worker takes it (``not_before``: a job stopped by a
    full disk waits off the GPU, worker.requeue)."""
    at = as_utc(job.not_before)
    return at is not None and at > (now or utcnow())


def fail(
    session: Session,
    job: FineTuningJob,
    code: str,
    message: str,
    *,
    param: str | None = None,
    event: str | None = None,
    data: dict[str, Any] | None = None,
) -> None:
    """Fail a job with the error object ``{code, message, param}``; ``event`` (default "Job failed:
    <message>") is what its event says, ``data`` (e.g. the error's type, a data file's line errors) what
    that event carries: a failure has this one error event."""
    set_status(
        session,
        job,
        JobStatus.failed,
        message=event or f"Job failed: {message}",
        error=job_error(code, message, param),
        data=data,
    )


def succeed(session: Session, job: FineTuningJob, message: str) -> None:
    """Mark a job succeeded (its results are set by the caller in the same transaction)."""
    set_status(session, job, JobStatus.succeeded, message=message)


def cancel(session: Session, job: FineTuningJob, message: str) -> None:
    """Mark a job cancelled."""
    set_status(session, job, JobStatus.cancelled, message=message)


def request_cancel(session: Session, job: FineTuningJob) -> None:
    """A user's cancel: a waiting or paused job is cancelled at once, a running one is flagged and stops
    at its next step (its runner writes ``cancelled``). The caller refuses terminal jobs first."""
    if job.cancel_requested:
        return
    job.cancel_requested = True
    if job.status == JobStatus.paused.value:
        cancel(session, job, "Job cancelled while paused")
    elif job.status in PENDING:
        cancel(session, job, "Job cancelled before it started")
    else:
        add_event(
            session,
            job.id,
            "Cancellation requested; the job stops after the current step",
            data={"status": job.status, "cancel_requested": True},
        )


def pause(session: Session, job: FineTuningJob, message: str) -> None:
    """Mark a job paused: a running one once its runner stopped (its checkpoint kept, its run ended), a
    waiting one at once (a gang forming for it released). A run's attempt is given back, as for a
    preemption: a pause is no failure, and pausing often must not use up the attempts."""
    if job.status == JobStatus.running.value:
        job.attempts = max(0, job.attempts - 1)
    session.execute(delete(JobNode).where(JobNode.job_id == job.id, JobNode.attempt == job.attempts + 1))
    job.worker_hostname, job.heartbeat_at = None, None
    set_status(
        session, job, JobStatus.paused, message=message, data={"resume_step": resume_step(session, job)}
    )


#: The statuses a pause applies to (the others: 409 ``job_not_pausable``, or a no-op for ``paused``).
PAUSABLE = (*PENDING, JobStatus.running.value)


def request_pause(session: Session, job: FineTuningJob) -> None:
    """A user's pause of ``job`` (row locked by the caller): a waiting job is paused at once (its message,
    when a worker takes it, claims another job or none), a running one is flagged and stops at its next
    step; a paused job or a pending pause is left as it is. The caller refuses the other statuses (not
    :data:`PAUSABLE`) and a pending cancel first."""
    if job.status == JobStatus.paused.value or job.pause_requested:
        return
    if job.status in PENDING:
        pause(session, job, "Job paused while waiting in its queue")
        return
    job.pause_requested = True
    add_event(
        session,
        job.id,
        "Pause requested; the job stops after the current step, checkpointing there",
        data={"status": job.status, "pause_requested": True},
    )


def resume(session: Session, job: FineTuningJob) -> str:
    """Put a paused job (row locked by the caller) back in its queue; the queue to send it to."""
    if job.status != JobStatus.paused.value:
        raise ValueError(f"job {job.id} is {job.status}, not paused")
    set_status(session, job, JobStatus.queued, message=f"Job resumed: queued {resume_words(session, job)}")
    return job.queue

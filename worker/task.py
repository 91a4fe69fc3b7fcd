"""The run task (``zenflow.run_job``) and the supervision of the job's child process.

:func:`run_job`:

1. takes the message as a turn on its queue and claims, under the row locks, the job fair share
   puts first (:func:`store.jobs.claim_next`; the message's own job only when it is a dead run to
   take over): a terminal job, or one running elsewhere with a fresh heartbeat, is never run twice;
   while only jobs of teams at their running quota wait, it re-checks for ``quota_hold_seconds``
   and then sends the message back to the queue;
2. runs ``python -m worker.job.runner JOB_ID`` as the job's R ranks (``resources.gpus``; one for most
   jobs) under torch's elastic agent (:class:`trainer.run.launch.NodeRanks`: the agent in a child process
   of the worker, dying with it, each rank in a fresh process, so CUDA is initialised only there; rank r
   on the worker's r-th GPU, or gloo CPU ranks on a worker without GPUs where ``cpu_ranks`` allows), and
   waits, escalating a cancel or a pause the runner does not honour within ``CANCEL_GRACE_SECONDS`` to
   SIGTERM and then SIGKILL (the job is then cancelled or paused by :mod:`worker.requeue`). The agent takes the group down when a rank dies; that rank's exit code is the job's. A
   job asking for more ranks than this worker has is never run on fewer: it goes back to its queue (the
   one of its size) with the attempt counted, or fails when none are left;
3. if the subprocess ended without a terminal state (crash, OOM kill, preemption), re-queues the job
   (it resumes from its last checkpoint) while attempts remain, else fails it; a runner interrupted by
   a database outage is re-queued, never failed for it, and one stopped by a full disk is re-queued at
   once without counting an attempt, to wait off the GPU before it runs again (:mod:`worker.requeue`).

While it waits, the worker beats the job's heartbeat (every ``heartbeat_interval_seconds``, only while
the job is still running here), as the runner's monitor does: the claim's heartbeat would otherwise
have to last through the runner's start-up (interpreter, imports, loading the job), which no interval
bounds and which a loaded machine stretches past a short ``heartbeat_timeout_seconds``.

A worker that is killed outright leaves its job running with a heartbeat that goes stale;
:mod:`worker.reaper` re-queues it, and a restarted worker re-queues its own node's jobs at
once. On a warm shutdown (:mod:`worker.hooks`) the running job is preempted (SIGTERM:
checkpoint, exit) and re-queued without counting an attempt. A re-queue commits the row, then sends
the message and stamps ``dispatched_at`` (:mod:`worker.dispatch`). Does not import torch.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import select, update

from store import gang, jobs
from store.db import session_scope
from store.gang import Member
from store.orm import FineTuningJob, JobRun, JobStatus
from store.settings import Settings, get_settings
from trainer.run.launch import TERM_GRACE_SECONDS, NodeRanks
from worker import gang as gang_worker
from worker import rank_template
from worker.broker import TASK_NAME, celery_app, enqueue_job, queue_for_gpus
from worker.dispatch import dispatch_job
from worker.errors import public_message
from worker.job.runner import HOSTNAME_ENV, JOB_RUNNER_MODULE
from worker.metrics.nvml import detect_gpus
from worker.metrics.server import job_process_exited
from worker.requeue import describe_exit, settle_after_exit

log = logging.getLogger("zenflow.worker")

#: After cancel_requested (or pause_requested), how long the runner may take to checkpoint and stop
#: before it is killed.
CANCEL_GRACE_SECONDS = 120.0
_POLL_SECONDS = 1.0

#: This worker's nodename (``-n``), recorded in job.worker_hostname: set on celeryd_init (CLI worker,
#: worker.hooks) or by the embedded worker (the request's hostname is the bare host there).
_node_hostname: str | None = None


def set_node_hostname(name: str | None) -> None:
    global _node_hostname
    _node_hostname = name


def node_hostname() -> str | None:
    return _node_hostname


# --- the task ---------------------------------------------------------------------------------


#: While only held jobs wait (their team at its running quota, their rows locked), how often a worker
#: re-checks.
HOLD_POLL_SECONDS = 1.0


def claim_next_job(
    message_job_id: str, hostname: str, settings: Settings, *, queue: str | None = None
) -> jobs.NextClaim:
    """For a message taken from the queue: claim the job fair share puts first (store.jobs.claim_next),
    or a node of a multi-node job's gang (store.gang.next_gang, worker.gang)."""
    return gang_worker.claim(message_job_id, hostname, settings, queue)


def claim_for_message(
    message_job_id: str, hostname: str, settings: Settings, *, queue: str | None = None
) -> jobs.NextClaim:
    """:func:`claim_next_job`, re-checked every second for up to ``quota_hold_seconds`` while only held
    jobs wait (their team at its running quota, or their rows locked by another transaction); then the
    message goes back to the queue (for one of them), so the broker keeps one message per queued job."""
    deadline = time.monotonic() + settings.quota_hold_seconds
    while True:
        result = claim_next_job(message_job_id, hostname, settings, queue=queue)
        if result.outcome is not jobs.Claim.held or time.monotonic() >= deadline:
            break
        time.sleep(HOLD_POLL_SECONDS)
    if result.outcome is jobs.Claim.held and result.job_id and result.queue:
        enqueue_job(result.job_id, queue=result.queue)
    return result


def finish_after_exit(
    job_id: str, rc: int, hostname: str, settings: Settings, *, preempted: bool = False
) -> str:
    """After the runner exits: leave a terminal job alone, else re-queue it (or fail: no attempts left);
    see :mod:`worker.requeue` (interrupted and disk-full exits too). What happened, for the logs.

    ``preempted``: we sent the runner SIGTERM (worker shutdown), so its death is not the job's fault.
    """
    # enqueue_job is looked up at call time (tests patch it).
    return settle_after_exit(
        job_id, rc, hostname, settings, preempted=preempted, enqueue=lambda j, q: enqueue_job(j, queue=q)
    )


def child_env(settings: Settings, hostname: str) -> dict[str, str]:
    """The runner's environment: ours (CUDA_VISIBLE_DEVICES included) plus our resolved settings."""
    env = dict(os.environ)
    env.update(
        ZENFLOW_DATABASE_URL=settings.resolved_database_url,
        ZENFLOW_DATA_DIR=str(settings.data_dir.resolve()),
        ZENFLOW_JOBS_DIR=str(settings.resolved_jobs_dir),
        ZENFLOW_FILES_DIR=str(settings.resolved_files_dir),
        ZENFLOW_HEARTBEAT_INTERVAL_SECONDS=str(settings.heartbeat_interval_seconds),
        ZENFLOW_MAX_JOB_ATTEMPTS=str(settings.max_job_attempts),
        ZENFLOW_HEARTBEAT_TIMEOUT_SECONDS=str(settings.heartbeat_timeout_seconds),
        ZENFLOW_JOB_DB_OUTAGE_SECONDS=str(settings.job_db_outage_seconds),
        ZENFLOW_JOB_DB_BUFFER_ITEMS=str(settings.job_db_buffer_items),
        **{HOSTNAME_ENV: hostname},
    )
    return env


# --- ranks ------------------------------------------------------------------------------------


def worker_devices() -> list[str]:
    """This worker's GPUs, as its ranks are to see them: the entries of ``CUDA_VISIBLE_DEVICES``
    (indices or UUIDs; empty or ``-1``: none), else every GPU NVML sees."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return [d.strip() for d in cvd.split(",") if d.strip() and d.strip() != "-1"]
    return [str(i) for i, _ in detect_gpus()]


def worker_ranks(settings: Settings, devices: list[str] | None = None) -> int:
    """How many ranks a job may have here: one per GPU; on a worker without GPUs, ``gpus_per_job``
    gloo CPU ranks where ``cpu_ranks`` allows them, else one."""
    devices = worker_devices() if devices is None else devices
    if devices:
        return len(devices)
    return settings.gpus_per_job if settings.cpu_ranks else 1


def claimed_ranks(job_id: str, settings: Settings) -> int:
    """The ranks the claimed job asks for (its ``resources``); its run in the ledger counts that many
    GPUs (store.jobs.claim opens it so already; a run opened with another count is corrected)."""
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(FineTuningJob, job_id)
        ranks = job.request.resources.gpus if job is not None else 1
        s.execute(
            update(JobRun)
            .where(JobRun.job_id == job_id, JobRun.ended_at.is_(None), JobRun.gpus != ranks)
            .values(gpus=ranks)
        )
    return ranks


def _queue_ranks(queue: str | None) -> int:
    """The job size a queue is for (``<base>-x<N>``: N; any other: 1)."""
    head, sep, n = (queue or "").rpartition("-x")
    return int(n) if sep and head and n.isdigit() and int(n) > 1 else 1


def send_back_oversized(job_id: str, ranks: int, have: int, hostname: str, settings: Settings) -> str:
    """A job asking for more ranks than this worker has: back to the queue of its size (its ``queue``
    re-cut for ``ranks`` when it names another size), the attempt counted, or failed when none are left.
    What happened, for the logs."""
    url = settings.resolved_database_url

    def settle() -> tuple[str, str | None]:
        with session_scope(url) as s:
            job = jobs.lock_job(s, job_id)
            if job is None or job.status != JobStatus.running.value or job.worker_hostname != hostname:
                return "not-ours", None
            why = f"this job needs {ranks} GPUs (resources.gpus) and worker {hostname} runs jobs of {have}"
            if job.attempts >= settings.max_job_attempts:
                jobs.fail(
                    s,
                    job,
                    "insufficient_gpus",
                    f"{why}; gave up after {job.attempts} attempts: start "
                    f"a worker with --gpus-per-job {ranks} for the queue {queue_for_gpus(ranks, job.queue)}",
                )
                return "failed", None
            if _queue_ranks(job.queue) != ranks:
                base = job.queue.rpartition("-x")[0] if _queue_ranks(job.queue) > 1 else job.queue
                job.queue = queue_for_gpus(ranks, base)
            return "requeued", jobs.requeue(s, job, f"Not run: {why}")

    outcome, queue = settle()
    if queue is not None:
        dispatch_job(url, job_id, queue, enqueue=lambda j, q: enqueue_job(j, queue=q))
    return outcome


def rank_launch(
    job_id: str,
    ranks: int,
    hostname: str,
    settings: Settings,
    devices: list[str] | None = None,
    *,
    gang: Member | None = None,
) -> NodeRanks:
    """The job's ranks under the elastic agent, not started: ``ranks`` runners with the worker's
    environment and the ``env://`` variables, rank r on the r-th GPU, or CPU ranks (an even share of
    the cores each) on a worker without GPUs. One rendezvous id per run; a gang member's ranks join its
    gang's rendezvous (node 0's endpoint, the attempt's id) as node ``node_rank`` of ``nodes``."""
    devices = worker_devices() if devices is None else devices
    env = rank_template.with_template(child_env(settings, hostname), settings, gpus=bool(devices))
    return NodeRanks(
        [sys.executable, "-m", JOB_RUNNER_MODULE, job_id],
        nproc_per_node=ranks,
        nnodes=gang.nodes if gang else 1,
        rdzv_endpoint=gang.rdzv_endpoint if gang else None,
        rdzv_host=gang.node_rank == 0 if gang else None,
        local_addr=(settings.worker_address or None) if gang else None,
        run_id=gang.run_id if gang else f"{job_id}-{uuid.uuid4().hex[:12]}",
        devices=devices[:ranks] if devices else None,
        env=env,
        term_grace=TERM_GRACE_SECONDS,
    )


_current_lock = threading.Lock()
_current: NodeRanks | None = None
_preempted = threading.Event()


#: Set while this process's worker stops (:meth:`worker.embedded.EmbeddedWorker.stop`): a message it still
#: gets (the preempted job's own re-queue, delivered before Celery's loop sees its stop) goes back to
#: the queue unrun, for the next worker or this one's next start, instead of starting the job again.
_stopping = threading.Event()


def stop_taking_jobs(stopping: bool = True) -> None:
    """From now on (``stopping``), or again (False, at a start), this process's worker runs no new job."""
    if stopping:
        _stopping.set()
    else:
        _stopping.clear()


def preempt_current(sig: int = signal.SIGTERM) -> bool:
    """Signal the running job's ranks (SIGTERM: checkpoint and exit 75); False when none runs."""
    with _current_lock:
        group = _current
    if group is None or not group.alive():
        return False
    _preempted.set()
    group.kill() if sig == signal.SIGKILL else group.terminate(sig)
    return True


def _beat_job(job_id: str, hostname: str, settings: Settings) -> None:
    with session_scope(settings.resolved_database_url) as s:
        jobs.beat(s, job_id, hostname)


def _stop_requested(job_id: str, settings: Settings) -> bool:
    """A user's cancel or pause of the job is pending (its runner is to stop at its next step)."""
    with session_scope(settings.resolved_database_url) as s:
        row = s.execute(
            select(FineTuningJob.cancel_requested, FineTuningJob.pause_requested).where(
                FineTuningJob.id == job_id
            )
        ).first()
        return row is not None and bool(row.cancel_requested or row.pause_requested)


def run_child(
    job_id: str,
    hostname: str,
    settings: Settings,
    *,
    cancel_grace: float = CANCEL_GRACE_SECONDS,
    ranks: int = 1,
    gang: Member | None = None,
    beat: Callable[[], None] | None = None,
) -> int:
    """Run the job's ``ranks`` runners to the end; the return code (negative: killed by a signal): the
    code of the rank that failed first, else 0. A gang member runs its node's ranks of the gang's
    group; ``beat`` (default: the job's heartbeat) is what it refreshes every heartbeat interval."""
    global _current
    group = rank_launch(job_id, ranks, hostname, settings, gang=gang)
    with _current_lock:
        group.start()
        _current = group
        _preempted.clear()
    watch = _Supervision(job_id, hostname, settings, group, cancel_grace, beat)
    try:
        while True:
            watch.beat_if_due()
            end = watch.ended(ranks)
            if end is not None:
                return end
            watch.stop_if_asked()
    finally:
        with _current_lock:
            _current = None
        group.close()  # after an exception too: nothing of the job outlives its supervision


class _Supervision:
    """What :func:`run_child` does each round while the job's ranks run: the heartbeat, their exit, and a
    cancel or pause the runner ignores past ``cancel_grace`` (terminated, then killed)."""

    def __init__(
        self,
        job_id: str,
        hostname: str,
        settings: Settings,
        group: Any,
        cancel_grace: float,
        beat: Callable[[], None] | None,
    ) -> None:
        self.job_id, self.hostname, self.settings, self.group = job_id, hostname, settings, group
        self.cancel_grace, self.beat = cancel_grace, beat
        self.cancel_seen: float | None = None
        self.terminated: float | None = None
        self.last_check = self.last_beat = 0.0

    def beat_if_due(self) -> None:
        if time.monotonic() - self.last_beat < self.settings.heartbeat_interval_seconds:
            return
        self.last_beat = time.monotonic()
        try:
            self.beat() if self.beat is not None else _beat_job(self.job_id, self.hostname, self.settings)
        except Exception as e:  # the database is away: the runner's monitor copes with that
            log.debug("job %s: heartbeat failed: %s", self.job_id, public_message(e))

    def ended(self, ranks: int) -> int | None:
        """The group's return code once it has exited (waiting up to a poll), else None."""
        try:
            end = self.group.wait(timeout=_POLL_SECONDS)
        except subprocess.TimeoutExpired:
            return None
        for pid in self.group.run_pids:  # the processes that ran the runner (forked ones included)
            _report_exit(pid)
        if end.rank is not None and ranks > 1:
            log.warning(
                "job %s: rank %d of %d exited (%s); the agent stopped the other ranks",
                self.job_id,
                end.rank,
                ranks,
                describe_exit(end.code),
            )
        code: int = end.code
        return code

    def stop_if_asked(self) -> None:
        """A cancel or pause the runner has not acted on within the grace: terminate, then kill."""
        now = time.monotonic()
        if self.terminated is not None:
            if now - self.terminated > TERM_GRACE_SECONDS:
                self.group.kill()
            return
        if now - self.last_check >= 5 * _POLL_SECONDS:
            self.last_check = now
            try:
                if self.cancel_seen is None and _stop_requested(self.job_id, self.settings):
                    self.cancel_seen = now
            except Exception as e:  # the database is away: try again next round
                log.warning("job %s: cancel check failed: %s", self.job_id, public_message(e))
        if self.cancel_seen is not None and now - self.cancel_seen > self.cancel_grace:
            log.warning(
                "job %s: runner ignored the cancel or pause for %.0fs; terminating it",
                self.job_id,
                self.cancel_grace,
            )
            self.group.terminate()
            self.terminated = now


def _report_exit(pid: int) -> None:
    """Fold the dead runner's metric samples (a metrics problem never stops a worker)."""
    try:
        job_process_exited(pid)
    except Exception:
        log.exception("worker metrics: could not fold the runner's samples")


def run_gang_member(job_id: str, hostname: str, settings: Settings, member: Member | None) -> str:
    """This worker's node of a multi-node job: wait for the gang to form (worker.gang), run this node's
    ranks in the gang's group, settle. What happened, for the logs."""
    if member is None:
        return "nothing"
    formed = gang_worker.wait_formed(job_id, hostname, settings)
    if formed is None:
        return "released"
    node0 = gang_worker.node0_hostname(job_id, settings)
    ranks = node_ranks(job_id, settings)
    log.info(
        "job %s: node %d of %d on %s (%s)", job_id, formed.node_rank, formed.nodes, hostname, formed.run_id
    )
    rc = run_child(
        job_id,
        node0,
        settings,
        ranks=ranks,
        gang=formed,
        beat=lambda: gang_worker.beat(formed, hostname, node0, settings),
    )
    outcome = gang_worker.settle(formed, rc, hostname, node0, settings, preempted=_preempted.is_set())
    log.info("job %s: node %d's ranks exited (%s): %s", job_id, formed.node_rank, describe_exit(rc), outcome)
    return outcome


def node_ranks(job_id: str, settings: Settings) -> int:
    """The ranks the job runs on each of its nodes (its request's ``resources.gpus``)."""
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(FineTuningJob, job_id)
        return job.request.resources.gpus if job is not None else 1


def run_job(self: Any, job_id: str, gang_join: bool = False) -> str:
    """Run one job (see the module docstring); returns what happened, for the logs. ``gang_join``: the
    message only recruits a member for the job's forming gang (worker.gang)."""
    if _stopping.is_set():
        from celery.exceptions import Reject

        raise Reject(f"job {job_id}: this worker is stopping", requeue=True)
    settings = get_settings()
    hostname = _node_hostname or self.request.hostname or f"celery@{socket.gethostname()}"
    if gang_join:
        return run_gang_member(job_id, hostname, settings, gang_worker.join(job_id, hostname, settings))
    # The message is a turn on its queue: the job that runs is the one fair share puts first.
    routing_key = (self.request.delivery_info or {}).get("routing_key")
    claimed = claim_for_message(job_id, hostname, settings, queue=routing_key)
    if claimed.outcome in (jobs.Claim.forming, jobs.Claim.joined) and claimed.job_id is not None:
        with session_scope(settings.resolved_database_url) as s:
            member = gang.view(s, claimed.job_id, hostname)
        return run_gang_member(claimed.job_id, hostname, settings, member)
    if claimed.outcome is not jobs.Claim.claimed or claimed.job_id is None:
        log.info("message for job %s: %s, nothing run", job_id, claimed.outcome.value)
        return claimed.outcome.value
    job_id = claimed.job_id
    ranks, have = claimed_ranks(job_id, settings), worker_ranks(settings)
    if ranks > have:
        outcome = send_back_oversized(job_id, ranks, have, hostname, settings)
        log.warning("job %s needs %d ranks, this worker has %d: %s", job_id, ranks, have, outcome)
        return outcome
    log.info("job %s: running on %s%s", job_id, hostname, f" as {ranks} ranks" if ranks > 1 else "")
    rc = run_child(job_id, hostname, settings, ranks=ranks)
    outcome = finish_after_exit(job_id, rc, hostname, settings, preempted=_preempted.is_set())
    log.info("job %s: runner exited (%s): %s", job_id, describe_exit(rc), outcome)
    return outcome


# Registered by call rather than as a decorator: Celery is untyped, and its decorator would leave
# run_job untyped too. The task is sent by name (worker.broker.TASK_NAME), never through this object.
celery_app.task(name=TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)(
    run_job
)

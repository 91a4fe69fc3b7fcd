"""The run task (``zenflow.run_job``) and the supervision of the job's child process.

:func:`run_job`:

1. takes the message as a turn on its queue and claims, under the row locks, the job fair share
   puts first (:func:`store.jobs.claim_next`; the message's own job only when it is a dead run to
   take over): a terminal job, or one running elsewhere with a fresh heartbeat, is never run twice;
   while only jobs of teams at their running quota wait, it re-checks for ``quota_hold_seconds``
   and then sends the message back to the queue;
2. runs ``python -m trainer.worker.job_runner JOB_ID`` in a fresh subprocess (a killable PID; CUDA is
   initialised only there; ``PR_SET_PDEATHSIG`` makes it die with the worker; it inherits
   ``CUDA_VISIBLE_DEVICES``) and waits, escalating a cancel the runner does not honour within
   ``CANCEL_GRACE_SECONDS`` to SIGTERM and then SIGKILL;
3. if the subprocess ended without a terminal state (crash, OOM kill, preemption), re-queues the job
   (it resumes from its last checkpoint) while attempts remain, else fails it; a runner interrupted by
   a database outage is re-queued, never failed for it, and one stopped by a full disk is re-queued
   after a backoff without counting an attempt (:mod:`trainer.worker.requeue`).

A worker that is killed outright leaves its job running with a heartbeat that goes stale;
:mod:`trainer.worker.reaper` re-queues it, and a restarted worker re-queues its own node's jobs at
once. On a warm shutdown (:mod:`trainer.worker.hooks`) the running job is preempted (SIGTERM:
checkpoint, exit) and re-queued without counting an attempt. A re-queue commits the row, then sends
the message and stamps ``dispatched_at`` (:mod:`trainer.worker.dispatch`). Does not import torch.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from sqlalchemy import select

from store import jobs
from store.db import session_scope
from store.models import FineTuningJob
from store.settings import Settings, get_settings
from trainer.worker.broker import TASK_NAME, celery_app, enqueue_job
from trainer.worker.errors import public_message
from trainer.worker.job_runner import HOSTNAME_ENV, JOB_RUNNER_MODULE
from trainer.worker.metrics_server import job_process_exited
from trainer.worker.requeue import describe_exit, end_backoff, settle_after_exit

log = logging.getLogger("zenflow.worker")

#: After cancel_requested, how long the runner may take to checkpoint and stop before it is killed.
CANCEL_GRACE_SECONDS = 120.0
#: How long a terminated runner gets to exit before SIGKILL.
TERM_GRACE_SECONDS = 30.0
_POLL_SECONDS = 1.0

#: This worker's nodename (``-n``), recorded in job.worker_hostname: set on celeryd_init (CLI worker,
#: trainer.worker.hooks) or by the embedded worker (the request's hostname is the bare host there).
_node_hostname: str | None = None


def set_node_hostname(name: str | None) -> None:
    global _node_hostname
    _node_hostname = name


def node_hostname() -> str | None:
    return _node_hostname


# --- the task ---------------------------------------------------------------------------------


def claim_job(job_id: str, hostname: str, settings: Settings) -> str:
    """Decide under the row lock whether this worker runs the job: "claimed" or why not."""
    with session_scope(settings.resolved_database_url) as s:
        return jobs.claim(s, jobs.lock_job(s, job_id), hostname, max_attempts=settings.max_job_attempts,
                          heartbeat_timeout_seconds=settings.heartbeat_timeout_seconds)


#: While only jobs held back by their team's max_running_jobs quota wait, how often a worker re-checks.
HOLD_POLL_SECONDS = 1.0


def claim_next_job(message_job_id: str, hostname: str, settings: Settings, *,
                   queue: str | None = None) -> jobs.NextClaim:
    """For a message taken from the queue: claim the job fair share puts first (store.jobs.claim_next)."""
    with session_scope(settings.resolved_database_url) as s:
        return jobs.claim_next(s, hostname, settings, message_job_id=message_job_id, queue=queue)


def claim_for_message(message_job_id: str, hostname: str, settings: Settings, *,
                      queue: str | None = None) -> jobs.NextClaim:
    """:func:`claim_next_job`, re-checked every second for up to ``quota_hold_seconds`` while only jobs
    held back by their team's running quota wait; then the message goes back to the queue (for one of
    them), so the broker keeps one message per queued job."""
    deadline = time.monotonic() + settings.quota_hold_seconds
    while True:
        result = claim_next_job(message_job_id, hostname, settings, queue=queue)
        if result.outcome is not jobs.Claim.held or time.monotonic() >= deadline:
            break
        time.sleep(HOLD_POLL_SECONDS)
    if result.outcome is jobs.Claim.held and result.job_id and result.queue:
        enqueue_job(result.job_id, queue=result.queue)
    return result


def finish_after_exit(job_id: str, rc: int, hostname: str, settings: Settings, *, preempted: bool = False) -> str:
    """After the runner exits: leave a terminal job alone, else re-queue it (or fail: no attempts left);
    see :mod:`trainer.worker.requeue` (interrupted and disk-full exits too). What happened, for the logs.

    ``preempted``: we sent the runner SIGTERM (worker shutdown), so its death is not the job's fault.
    """
    # enqueue_job is looked up at call time (tests patch it).
    return settle_after_exit(job_id, rc, hostname, settings, preempted=preempted,
                             enqueue=lambda j, q: enqueue_job(j, queue=q))


def _pdeathsig(parent_pid: int) -> None:
    """In the child before exec: die with SIGKILL when the spawning thread's process dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


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


_current_lock = threading.Lock()
_current: subprocess.Popen[bytes] | None = None
_preempted = threading.Event()


def preempt_current(sig: int = signal.SIGTERM) -> bool:
    """Signal the running job's subprocess (SIGTERM: checkpoint and exit 75), or end the disk-full
    backoff of a job waiting here (it is re-queued at once); False when neither."""
    with _current_lock:
        proc = _current
    if proc is None or proc.poll() is not None:
        return end_backoff()
    _preempted.set()
    proc.send_signal(sig)
    return True


def _cancel_requested(job_id: str, settings: Settings) -> bool:
    with session_scope(settings.resolved_database_url) as s:
        return bool(s.execute(select(FineTuningJob.cancel_requested).where(FineTuningJob.id == job_id)).scalar())


def run_child(job_id: str, hostname: str, settings: Settings, *, cancel_grace: float = CANCEL_GRACE_SECONDS) -> int:
    """Run the job runner subprocess to its end; its return code (negative: killed by a signal)."""
    global _current
    parent = os.getpid()
    proc = subprocess.Popen(
        [sys.executable, "-m", JOB_RUNNER_MODULE, job_id],
        env=child_env(settings, hostname),
        preexec_fn=(lambda: _pdeathsig(parent)) if sys.platform.startswith("linux") else None,
        close_fds=True,
    )
    with _current_lock:
        _current = proc
        _preempted.clear()
    cancel_seen: float | None = None
    terminated: float | None = None
    last_check = 0.0
    try:
        while True:
            try:
                rc = proc.wait(timeout=_POLL_SECONDS)
            except subprocess.TimeoutExpired:
                pass
            else:
                _report_exit(proc.pid)
                return rc
            now = time.monotonic()
            if terminated is not None:
                if now - terminated > TERM_GRACE_SECONDS:
                    proc.kill()
                continue
            if now - last_check >= 5 * _POLL_SECONDS:
                last_check = now
                try:
                    if cancel_seen is None and _cancel_requested(job_id, settings):
                        cancel_seen = now
                except Exception as e:  # the database is away: try again next round
                    log.warning("job %s: cancel check failed: %s", job_id, public_message(e))
            if cancel_seen is not None and now - cancel_seen > cancel_grace:
                log.warning("job %s: runner ignored the cancel for %.0fs; terminating it", job_id, cancel_grace)
                proc.terminate()
                terminated = now
    finally:
        with _current_lock:
            _current = None


def _report_exit(pid: int) -> None:
    """Fold the dead runner's metric samples (a metrics problem never stops a worker)."""
    try:
        job_process_exited(pid)
    except Exception:
        log.exception("worker metrics: could not fold the runner's samples")


@celery_app.task(name=TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_job(self: Any, job_id: str) -> str:
    """Run one job (see the module docstring); returns what happened, for the logs."""
    settings = get_settings()
    hostname = _node_hostname or self.request.hostname or f"celery@{socket.gethostname()}"
    # The message is a turn on its queue: the job that runs is the one fair share puts first.
    routing_key = (self.request.delivery_info or {}).get("routing_key")
    claimed = claim_for_message(job_id, hostname, settings, queue=routing_key)
    if claimed.outcome is not jobs.Claim.claimed or claimed.job_id is None:
        log.info("message for job %s: %s, nothing run", job_id, claimed.outcome.value)
        return claimed.outcome.value
    job_id = claimed.job_id
    log.info("job %s: running on %s", job_id, hostname)
    rc = run_child(job_id, hostname, settings)
    outcome = finish_after_exit(job_id, rc, hostname, settings, preempted=_preempted.is_set())
    log.info("job %s: runner exited (%s): %s", job_id, describe_exit(rc), outcome)
    return outcome



"""The run task (``zenflow.run_job``) and the supervision of the job's child process.

:func:`run_job`:

1. claims the job under its row lock (:func:`store.jobs.claim`): a terminal job, or one running
   elsewhere with a fresh heartbeat, is not run (a redelivered message never starts a second run);
2. runs ``python -m trainer.worker.job_runner JOB_ID`` in a fresh subprocess (a killable PID; CUDA is
   initialised only there; ``PR_SET_PDEATHSIG`` makes it die with the worker; it inherits
   ``CUDA_VISIBLE_DEVICES``) and waits, escalating a cancel the runner does not honour within
   ``CANCEL_GRACE_SECONDS`` to SIGTERM and then SIGKILL;
3. if the subprocess ended without a terminal state (crash, OOM kill, preemption), re-queues the job
   (it resumes from its last checkpoint) while attempts remain, else fails it.

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
from store.models import FineTuningJob, JobStatus
from store.settings import Settings, get_settings
from trainer.worker.broker import TASK_NAME, celery_app, enqueue_job
from trainer.worker.dispatch import dispatch_job
from trainer.worker.job_runner import EXIT_PREEMPTED, HOSTNAME_ENV, JOB_RUNNER_MODULE
from trainer.worker.metrics_server import job_process_exited

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


def _describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        hint = " (out of memory?)" if -rc == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exit code {rc}"


def finish_after_exit(job_id: str, rc: int, hostname: str, settings: Settings, *, preempted: bool = False) -> str:
    """After the runner exits: leave a terminal job alone, else re-queue it (or fail: no attempts left).

    ``preempted``: we sent the runner SIGTERM (worker shutdown), so its death is not the job's fault.
    """
    with session_scope(settings.resolved_database_url) as s:
        job = jobs.lock_job(s, job_id)
        if job is None or JobStatus(job.status).terminal:
            return "done"
        if job.status != JobStatus.running.value or job.worker_hostname != hostname:
            return "not-ours"
        if job.cancel_requested:
            jobs.cancel(s, job, f"Job cancelled at step {job.global_step}")
            return "cancelled"
        if rc == EXIT_PREEMPTED or (preempted and rc == -signal.SIGTERM):
            job.attempts = max(0, job.attempts - 1)  # preemption is not the job's fault
            why = "Training preempted (worker shutting down)"
        else:
            why = f"Training process ended abnormally ({_describe_exit(rc)})"
            if job.attempts >= settings.max_job_attempts:
                jobs.fail(s, job, "worker_lost", f"{why} on attempt {job.attempts}/{settings.max_job_attempts}")
                return "failed"
        queue = jobs.requeue(s, job, why)
    # enqueue_job is looked up at call time (tests patch it).
    dispatch_job(settings.resolved_database_url, job_id, queue, enqueue=lambda j, q: enqueue_job(j, queue=q))
    return "requeued"


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
        **{HOSTNAME_ENV: hostname},
    )
    return env


_current_lock = threading.Lock()
_current: subprocess.Popen[bytes] | None = None
_preempted = threading.Event()


def preempt_current(sig: int = signal.SIGTERM) -> bool:
    """Signal the running job's subprocess (SIGTERM: checkpoint and exit 75); False when none."""
    with _current_lock:
        proc = _current
    if proc is None or proc.poll() is not None:
        return False
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
                except Exception:
                    log.exception("job %s: cancel check failed", job_id)
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
    outcome = claim_job(job_id, hostname, settings)
    if outcome != "claimed":
        log.info("job %s: %s, not run", job_id, outcome)
        return outcome
    log.info("job %s: running on %s", job_id, hostname)
    rc = run_child(job_id, hostname, settings)
    outcome = finish_after_exit(job_id, rc, hostname, settings, preempted=_preempted.is_set())
    log.info("job %s: runner exited (%s): %s", job_id, _describe_exit(rc), outcome)
    return outcome



"""The Celery worker: one process per GPU that runs fine-tuning jobs from the database.

Start one per GPU, e.g. ``CUDA_VISIBLE_DEVICES=0 celery -A trainer.worker worker --pool solo -n gpu0@%h
-Q gpu-h100,gpu-default``, or ``python -m trainer.worker --gpus auto`` which launches one such process
per visible GPU with ``CUDA_VISIBLE_DEVICES`` set and the queue named after the GPU kind.

Configuration (from ``store.settings``): broker ``resolved_broker_url`` (Redis in deployment, kombu's
SQLAlchemy transport on a SQLite file in the embedded default), ``visibility_timeout`` =
``broker_visibility_timeout_seconds`` (longer than any job, or Redis hands a running job to a second
worker), concurrency 1, prefetch 1, ``acks_late`` and ``reject_on_worker_lost`` (a message is
acknowledged only once the task returns), no result backend (the database is the source of truth).

:func:`run_job` (task ``zenflow.run_job``):

1. locks the job row; skips a job that is terminal, or running elsewhere with a fresh heartbeat (a
   redelivered message never starts a second run); a job marked running by this same worker node is
   taken over (that run is dead: a node runs one job at a time); fails the job once
   ``max_job_attempts`` attempts were made; else counts the attempt and marks it running;
2. runs ``python -m trainer.job_runner JOB_ID`` in a fresh subprocess (a killable PID; CUDA is
   initialised only there; ``PR_SET_PDEATHSIG`` makes it die with the worker; it inherits
   ``CUDA_VISIBLE_DEVICES``) and waits, escalating a cancel the runner does not honour within
   ``CANCEL_GRACE_SECONDS`` to SIGTERM and then SIGKILL;
3. if the subprocess ended without a terminal state (crash, OOM kill, preemption), re-queues the job
   (it resumes from its last checkpoint) while attempts remain, else fails it.

A worker that is killed outright leaves its job running with a heartbeat that goes stale;
:mod:`trainer.reaper` (run periodically by every worker and by ``zenflow serve``) re-queues it, and a
restarted worker re-queues its own node's jobs at once. On a warm shutdown the running job is
preempted (SIGTERM: checkpoint, exit) and re-queued without counting an attempt. A re-queue commits
the row, then sends the message and stamps ``dispatched_at`` (trainer.dispatch, whose reconciler in
the same reaper thread re-sends a queued job whose message never reached the broker or was lost).

Importing this module does not import torch (the API imports it to enqueue).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta
from typing import Any

from celery import Celery, signals

from store.db import session_scope
from store.jobs import add_event, lock_job, set_status
from store.models import JobStatus, as_utc, utcnow
from store.settings import Settings, get_settings
from trainer.dispatch import dispatch_job

log = logging.getLogger("zenflow.worker")

TASK_NAME = "zenflow.run_job"
#: After cancel_requested, how long the runner may take to checkpoint and stop before it is killed.
CANCEL_GRACE_SECONDS = 120.0
#: How long a terminated runner gets to exit before SIGKILL.
TERM_GRACE_SECONDS = 30.0
_POLL_SECONDS = 1.0

celery_app = Celery("zenflow")
app = celery_app  # `celery -A trainer.worker` finds it under either name


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings for GPU workers, from the service settings."""
    url = settings.resolved_broker_url
    # kombu's SQLAlchemy transport hands its transport options to create_engine(): none for it.
    options = {} if url.startswith("sqla+") else {"visibility_timeout": settings.broker_visibility_timeout_seconds}
    return {
        "broker_url": url,
        "broker_transport_options": options,
        "broker_connection_retry_on_startup": True,
        "result_backend": None,
        "task_ignore_result": True,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_concurrency": 1,
        "worker_prefetch_multiplier": 1,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "worker_hijack_root_logger": False,
        "task_default_queue": settings.default_queue,
        "task_routes": {TASK_NAME: {"queue": settings.default_queue}},
        "task_serializer": "json",
        "accept_content": ["json"],
        "enable_utc": True,
    }


def configure_celery(settings: Settings | None = None) -> Celery:
    """(Re)apply the configuration from ``settings`` (default: get_settings()) to ``celery_app``."""
    conf = celery_config(settings or get_settings())
    if celery_app.conf.get("broker_url") not in (None, conf["broker_url"]) or (
        celery_app.conf.get("broker_transport_options") != conf["broker_transport_options"]
    ):
        celery_app.close()  # drop pooled connections to the old broker
        celery_app.amqp._producer_pool = None
    celery_app.conf.update(conf)
    return celery_app


configure_celery()


def queue_for_gpu_kind(kind: str | None) -> str:
    """Queue name for a GPU kind ("H100" -> "gpu-h100"); None -> the default queue."""
    if not kind:
        return get_settings().default_queue
    return "gpu-" + "".join(ch if ch.isalnum() else "-" for ch in kind.lower()).strip("-")


def enqueue_job(job_id: str, queue: str | None = None) -> str:
    """Send a job to the workers of ``queue`` (default: settings.default_queue); the Celery task id.

    Call after the job row is committed with status queued.
    """
    q = queue or get_settings().default_queue
    res = run_job.apply_async(args=[job_id], queue=q, routing_key=q)
    return str(res.id)


# --- telemetry hooks (trainer.telemetry; a metrics problem never stops a worker) -------------


def _serve_metrics() -> None:
    """Serve this worker's /metrics (port settings.worker_metrics_port, 0 = off) before any job runs."""
    try:
        from trainer.telemetry import serve_worker_metrics

        serve_worker_metrics()
    except Exception:
        log.exception("worker metrics: could not start")


def _telemetry_exited(pid: int) -> None:
    try:
        from trainer.telemetry import job_process_exited

        job_process_exited(pid)
    except Exception:
        log.exception("worker metrics: could not fold the runner's samples")


# --- the task ---------------------------------------------------------------------------------


def heartbeat_is_fresh(heartbeat_at: datetime | None, settings: Settings, now: datetime | None = None) -> bool:
    hb = as_utc(heartbeat_at)
    now = now or utcnow()
    return hb is not None and now - hb < timedelta(seconds=settings.heartbeat_timeout_seconds)


def _fail(s: Any, job: Any, code: str, message: str) -> None:
    set_status(s, job, JobStatus.failed, message=f"Job failed: {message}",
               error={"code": code, "message": message, "param": None})


def claim_job(job_id: str, hostname: str, settings: Settings) -> str:
    """Decide under the row lock whether this worker runs the job: "claimed" or why not."""
    with session_scope(settings.resolved_database_url) as s:
        job = lock_job(s, job_id)
        if job is None:
            return "missing"
        status = JobStatus(job.status)
        if status.terminal:
            return "terminal"
        if status is JobStatus.running and job.worker_hostname != hostname and heartbeat_is_fresh(job.heartbeat_at, settings):
            return "running-elsewhere"
        if job.cancel_requested:
            set_status(s, job, JobStatus.cancelled, message="Job cancelled before it started")
            return "cancelled"
        if job.attempts >= settings.max_job_attempts:
            _fail(s, job, "max_attempts_exceeded", f"gave up after {job.attempts} attempts")
            return "failed"
        job.attempts += 1
        job.worker_hostname = hostname
        job.heartbeat_at = utcnow()
        if status is JobStatus.running:
            add_event(s, job.id, "Previous run of this job was lost; taking it over", level="warning")
        resume = f", resuming from step {job.global_step}" if job.global_step else ""
        set_status(s, job, JobStatus.running,
                   message=f"Attempt {job.attempts}/{settings.max_job_attempts} started on {hostname}{resume}")
        return "claimed"


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
    from trainer.job_runner import EXIT_PREEMPTED

    requeue = ""
    with session_scope(settings.resolved_database_url) as s:
        job = lock_job(s, job_id)
        if job is None or JobStatus(job.status).terminal:
            return "done"
        if job.status != JobStatus.running.value or job.worker_hostname != hostname:
            return "not-ours"
        if job.cancel_requested:
            set_status(s, job, JobStatus.cancelled, message=f"Job cancelled at step {job.global_step}")
            return "cancelled"
        if rc == EXIT_PREEMPTED or (preempted and rc == -signal.SIGTERM):
            job.attempts = max(0, job.attempts - 1)  # preemption is not the job's fault
            why = "Training preempted (worker shutting down)"
        else:
            why = f"Training process ended abnormally ({_describe_exit(rc)})"
            if job.attempts >= settings.max_job_attempts:
                _fail(s, job, "worker_lost", f"{why} on attempt {job.attempts}/{settings.max_job_attempts}")
                return "failed"
        job.worker_hostname = None
        job.heartbeat_at = None
        set_status(s, job, JobStatus.queued,
                   message=f"{why}; re-queued to resume from step {job.global_step}")
        requeue = job.queue
    dispatch_job(settings.resolved_database_url, job_id, requeue,
                 enqueue=lambda j, q: enqueue_job(j, queue=q))  # looked up at call time (tests patch it)
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
    from trainer.job_runner import HOSTNAME_ENV

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
    from sqlalchemy import select

    from store.models import FineTuningJob

    with session_scope(settings.resolved_database_url) as s:
        return bool(s.execute(select(FineTuningJob.cancel_requested).where(FineTuningJob.id == job_id)).scalar())


def run_child(job_id: str, hostname: str, settings: Settings, *, cancel_grace: float = CANCEL_GRACE_SECONDS) -> int:
    """Run the job runner subprocess to its end; its return code (negative: killed by a signal)."""
    global _current
    parent = os.getpid()
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.job_runner", job_id],
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
                _telemetry_exited(proc.pid)
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


# --- worker lifecycle: reaper thread, warm-shutdown preemption, embedded worker --------------


_reaper = None
#: This worker's nodename (``-n``), recorded in job.worker_hostname: set on celeryd_init (CLI
#: worker) or by start_embedded_worker (the request's hostname is the bare host there).
_node_hostname: str | None = None


@signals.celeryd_init.connect
def _on_celeryd_init(sender: Any = None, **_: Any) -> None:
    global _node_hostname
    if isinstance(sender, str) and sender:
        _node_hostname = sender


@signals.worker_init.connect
def _on_worker_init(**_: Any) -> None:
    _serve_metrics()  # before the consumer starts, so every runner inherits PROMETHEUS_MULTIPROC_DIR


@signals.worker_ready.connect
def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    global _reaper
    from trainer.reaper import start_reaper_thread

    hostname = getattr(sender, "hostname", None) or getattr(getattr(sender, "controller", None), "hostname", None)
    if _reaper is None:
        _reaper = start_reaper_thread(own_hostname=hostname)


@signals.worker_shutting_down.connect
def _on_worker_shutting_down(**_: Any) -> None:
    if preempt_current():
        log.warning("worker shutting down: preempting the running job (it will be re-queued)")


class EmbeddedWorker:
    """A Celery worker (solo pool) running in a thread of this process; see start_embedded_worker."""

    def __init__(self, controller: Any, thread: threading.Thread, reaper: Any) -> None:
        self.controller, self.thread, self.reaper = controller, thread, reaper

    @property
    def hostname(self) -> str:
        return str(self.controller.hostname)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout: float = 60.0) -> None:
        """Preempt the running job (checkpoint, re-queue), stop consuming, join the thread."""
        from celery.worker import state

        if self.reaper is not None:
            self.reaper.stop()
        preempt_current()
        state.should_stop = 0
        self.thread.join(timeout)
        if self.thread.is_alive():
            preempt_current(signal.SIGKILL)
            state.should_terminate = 0
            self.thread.join(10)
        state.should_stop = None
        state.should_terminate = None
        global _node_hostname
        if _node_hostname == self.hostname:
            _node_hostname = None


def start_embedded_worker(
    *,
    queues: list[str] | None = None,
    hostname: str | None = None,
    reaper: bool = True,
    loglevel: str = "WARNING",
    settings: Settings | None = None,
    ready_timeout: float = 60.0,
) -> EmbeddedWorker:
    """Run a worker in a daemon thread of this process (``zenflow serve``); returns once it consumes.

    It takes jobs from ``queues`` (default: the default queue) on the configured broker, runs each in
    a subprocess like any worker, and (``reaper``) runs the stale-job reaper, which first re-queues
    jobs this node (``hostname``, default ``embedded@<host>``) was running before a restart.
    """
    from celery.worker import WorkController

    from trainer.reaper import start_reaper_thread

    global _node_hostname
    settings = settings or get_settings()
    configure_celery(settings)
    hostname = hostname or f"embedded@{socket.gethostname()}"
    _node_hostname = hostname
    ready = threading.Event()
    controller = WorkController(
        app=celery_app,
        hostname=hostname,
        pool="solo",
        concurrency=1,
        queues=queues or [settings.default_queue],
        loglevel=loglevel,
        ready_callback=lambda *_: ready.set(),
        without_heartbeat=True,
        without_mingle=True,
        without_gossip=True,
    )
    _serve_metrics()
    thread = threading.Thread(target=controller.start, name="zenflow-embedded-worker", daemon=True)
    thread.start()
    if not ready.wait(ready_timeout):
        raise RuntimeError(f"embedded worker did not start within {ready_timeout}s")
    r = start_reaper_thread(own_hostname=hostname, settings=settings) if reaper else None
    return EmbeddedWorker(controller, thread, r)


# --- launcher: one worker process per GPU ----------------------------------------------------


def detect_gpus() -> list[tuple[int, str]]:
    """(index, kind) of each NVIDIA GPU, via NVML (no torch); [] when there is none."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            name = name.decode() if isinstance(name, bytes) else str(name)
            words = [w for w in name.replace("NVIDIA", "").split() if any(c.isdigit() for c in w)]
            out.append((i, words[0] if words else name.split()[-1]))
        return out
    finally:
        pynvml.nvmlShutdown()


def _worker_argv(queues: list[str], nodename: str, loglevel: str) -> list[str]:
    return ["worker", "--pool", "solo", "--concurrency", "1", "-Q", ",".join(queues), "-n", nodename,
            "--loglevel", loglevel, "--without-gossip", "--without-mingle"]


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer.worker``: one Celery worker per GPU (or one CPU worker)."""
    p = argparse.ArgumentParser(prog="python -m trainer.worker", description=main.__doc__)
    p.add_argument("--gpus", default="auto", help="'auto', 'none' (one CPU worker) or indices like 0,1")
    p.add_argument("--queues", default=None,
                   help="comma-separated queues (default: gpu-<kind> of each GPU plus the default queue)")
    p.add_argument("--loglevel", default="INFO")
    args = p.parse_args(argv)
    settings = get_settings()
    found = dict(detect_gpus())
    if args.gpus == "none" or (args.gpus == "auto" and not found):
        gpus: list[tuple[int | None, str | None]] = [(None, None)]
    elif args.gpus == "auto":
        gpus = list(found.items())
    else:
        gpus = [(int(i), found.get(int(i))) for i in args.gpus.split(",")]

    def queues_for(kind: str | None) -> list[str]:
        if args.queues:
            return args.queues.split(",")
        return list(dict.fromkeys([queue_for_gpu_kind(kind), settings.default_queue]))

    # Our indices are NVML's (and nvidia-smi's), which count in PCI bus order; CUDA's default order is
    # fastest first, so without this CUDA_VISIBLE_DEVICES=1 could be another GPU on a mixed host.
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if len(gpus) == 1:
        idx, kind = gpus[0]
        if idx is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(idx)
        node = f"gpu{idx}@{socket.gethostname()}" if idx is not None else f"cpu@{socket.gethostname()}"
        celery_app.worker_main(_worker_argv(queues_for(kind), node, args.loglevel))
        return 0
    procs = []
    for n, (idx, kind) in enumerate(gpus):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(idx)}
        if settings.worker_metrics_port:
            # One /metrics port per worker process: base port + position in the launch order.
            env["ZENFLOW_WORKER_METRICS_PORT"] = str(settings.worker_metrics_port + n)
        cmd = [sys.executable, "-m", "celery", "-A", "trainer.worker",
               *_worker_argv(queues_for(kind), f"gpu{idx}@{socket.gethostname()}", args.loglevel)]
        procs.append(subprocess.Popen(cmd, env=env))

    def forward(sig: int, _frame: Any) -> None:
        for pr in procs:
            if pr.poll() is None:
                pr.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return max(pr.wait() for pr in procs)


if __name__ == "__main__":
    sys.exit(main())

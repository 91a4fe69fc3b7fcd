"""A Celery worker in a thread of the API process (``zenflow serve`` on embedded defaults)."""

from __future__ import annotations

import signal
import socket
import threading
from typing import Any

from store.settings import Settings, get_settings
from worker import hooks, rank_template, task
from worker.broker import celery_app, configure_celery, queue_for_gpus
from worker.capacity.presence import WorkerPresence, start_presence
from worker.reaper import ReaperThread, start_reaper_thread


class EmbeddedWorker:
    """A Celery worker (solo pool) running in a thread of this process; see start_embedded_worker."""

    def __init__(
        self,
        controller: Any,
        thread: threading.Thread,
        reaper: ReaperThread | None,
        presence: WorkerPresence | None = None,
    ) -> None:
        self.controller, self.thread, self.reaper, self.presence = controller, thread, reaper, presence

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
        task.stop_taking_jobs()  # before the preemption: its re-queued message must not start it here again
        task.preempt_current()
        state.should_stop = 0
        self.thread.join(timeout)
        if self.thread.is_alive():
            task.preempt_current(signal.SIGKILL)
            state.should_terminate = 0
            self.thread.join(10)
        state.should_stop = None
        state.should_terminate = None
        if task.node_hostname() == self.hostname:
            task.set_node_hostname(None)
        if self.presence is not None:
            self.presence.stop()
        rank_template.close()


def embedded_queues(settings: Settings) -> list[str]:
    """What the embedded worker consumes: the default queue, and with ``cpu_ranks`` and
    ``gpus_per_job`` N > 1 also the queue of N-rank jobs (run as gloo CPU ranks)."""
    queues = [settings.default_queue]
    if settings.cpu_ranks and settings.gpus_per_job > 1:
        queues.append(queue_for_gpus(settings.gpus_per_job, settings.default_queue))
    return queues


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

    It takes jobs from ``queues`` (default: :func:`embedded_queues`) on the configured broker, runs each in
    a subprocess like any worker, and (``reaper``) runs the stale-job reaper, which first re-queues
    jobs this node (``hostname``, default ``embedded@<host>``) was running before a restart; it
    registers in the worker registry with its measured capacity (worker.capacity.presence).
    """
    from celery.worker import WorkController

    settings = settings or get_settings()
    configure_celery(settings)
    hostname = hostname or f"embedded@{socket.gethostname()}"
    task.set_node_hostname(hostname)
    task.stop_taking_jobs(False)  # a worker started again in this process (tests, a restart)
    queues = queues or embedded_queues(settings)
    ready = threading.Event()
    controller = WorkController(
        app=celery_app,
        hostname=hostname,
        pool="solo",
        concurrency=1,
        queues=queues,
        loglevel=loglevel,
        ready_callback=lambda *_: ready.set(),
        without_heartbeat=True,
        without_mingle=True,
        without_gossip=True,
    )
    hooks.serve_metrics()
    thread = threading.Thread(target=controller.start, name="zenflow-embedded-worker", daemon=True)
    thread.start()
    if not ready.wait(ready_timeout):
        raise RuntimeError(f"embedded worker did not start within {ready_timeout}s")
    r = start_reaper_thread(own_hostname=hostname, settings=settings) if reaper else None
    return EmbeddedWorker(controller, thread, r, start_presence(hostname, queues, settings=settings))

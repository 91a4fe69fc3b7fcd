"""Celery signal hooks of a worker process: its node name, its /metrics server, its reaper thread, its
row in the worker registry (capacity and heartbeat, :mod:`worker.capacity.presence`), and preemption of
the running job on a warm shutdown.

Connected when this module is imported: through ``worker.celery_app`` (what ``celery -A
worker`` loads) or the embedded worker. A metrics problem never stops a worker; an engine tuning
(``ZENFLOW_ENGINE_TUNING``) the engine refuses does, at once, naming the field, before any job is taken.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals

from offload.config import check_tuning
from store.settings import get_settings
from worker import rank_template, task
from worker.capacity.presence import WorkerPresence, start_presence
from worker.metrics.server import serve_worker_metrics
from worker.reaper import ReaperThread, start_reaper_thread

log = logging.getLogger("zenflow.worker")

check_tuning(get_settings().engine_tuning)  # ValueError: ZENFLOW_ENGINE_TUNING names no valid tuning

_reaper: ReaperThread | None = None
_presence: WorkerPresence | None = None


def serve_metrics() -> None:
    """Serve this worker's /metrics (port settings.worker_metrics_port, 0 = off) before any job runs, so
    every runner inherits PROMETHEUS_MULTIPROC_DIR."""
    try:
        serve_worker_metrics()
    except Exception:
        log.exception("worker metrics: could not start")


def _on_celeryd_init(sender: Any = None, **_: Any) -> None:
    if isinstance(sender, str) and sender:
        task.set_node_hostname(sender)


def _on_worker_init(**_: Any) -> None:
    serve_metrics()


def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    global _reaper, _presence
    hostname = getattr(sender, "hostname", None) or getattr(
        getattr(sender, "controller", None), "hostname", None
    )
    if _reaper is None:
        _reaper = start_reaper_thread(own_hostname=hostname)
    name = task.node_hostname() or hostname  # what the worker's jobs record as their worker_hostname
    if _presence is None and name:
        try:
            _presence = start_presence(str(name), _consumed_queues(sender))
        except Exception:
            log.exception("worker registry: could not start")


def _consumed_queues(consumer: Any) -> list[str]:
    """The queue names a worker's consumer takes messages from."""
    task_consumer = getattr(consumer, "task_consumer", None)
    if task_consumer is not None:
        return [q.name for q in task_consumer.queues]
    return list(consumer.app.amqp.queues.consume_from)


def _on_worker_shutdown(**_: Any) -> None:
    if _presence is not None:
        _presence.stop()
    rank_template.close()


def _on_worker_shutting_down(**_: Any) -> None:
    if task.preempt_current():
        log.warning("worker shutting down: preempting the running job (it will be re-queued)")


# Connected by call rather than as decorators: Celery is untyped, and its decorator would leave these
# functions untyped too.
signals.celeryd_init.connect(_on_celeryd_init)
signals.worker_init.connect(_on_worker_init)
signals.worker_ready.connect(_on_worker_ready)
signals.worker_shutdown.connect(_on_worker_shutdown)
signals.worker_shutting_down.connect(_on_worker_shutting_down)

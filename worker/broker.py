"""The sending side of the job queue: the Celery app, its configuration, queue names, and
:func:`enqueue_job`, which sends the run task by name.

The API, the reaper and the dispatcher import this module alone; the task itself
(:mod:`worker.task`) is registered only in worker processes. Configuration (from
``store.settings``): broker ``resolved_broker_url`` (Redis in deployment, kombu's SQLAlchemy transport
on a SQLite file in the embedded default), ``visibility_timeout`` = ``broker_visibility_timeout_seconds``
(longer than any job, or Redis hands a running job to a second worker), concurrency 1, prefetch 1,
``acks_late`` and ``reject_on_worker_lost`` (a message is acknowledged only once the task returns), no
result backend (the database is the source of truth). Importing it does not import torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import Celery

from store.settings import Settings, get_settings

TASK_NAME = "zenflow.run_job"

#: ``enqueue(job_id, queue)``: hand a committed, queued job to the workers of ``queue``.
Enqueue = Callable[[str, str], object]

celery_app = Celery("zenflow")


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings for GPU workers, from the service settings."""
    url = settings.resolved_broker_url
    # kombu's SQLAlchemy transport hands its transport options to create_engine(): none for it.
    options = (
        {} if url.startswith("sqla+") else {"visibility_timeout": settings.broker_visibility_timeout_seconds}
    )
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
        # A worker started on this app (``celery -A worker``) registers the task and its hooks.
        "imports": ("worker.task", "worker.hooks"),
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


def queue_for_gpus(gpus: int, base: str | None = None) -> str:
    """Queue of jobs that need ``gpus`` ranks: ``base`` (default: settings.default_queue) for one,
    ``<base>-x<gpus>`` for more (served by workers started with ``--gpus-per-job gpus``)."""
    q = base or get_settings().default_queue
    return q if gpus <= 1 else f"{q}-x{gpus}"


def enqueue_job(job_id: str, queue: str | None = None) -> str:
    """Send a job to the workers of ``queue`` (default: settings.default_queue); the Celery task id.

    Call after the job row is committed with status queued.
    """
    q = queue or get_settings().default_queue
    res = celery_app.send_task(TASK_NAME, args=[job_id], queue=q, routing_key=q)
    return str(res.id)


def enqueue_gang_join(job_id: str, queue: str) -> str:
    """Recruit one more member for ``job_id``'s forming gang (store.gang): a message on the job's queue
    that only joins that gang (a worker taking it when the gang is full or gone does nothing)."""
    res = celery_app.send_task(
        TASK_NAME, args=[job_id], kwargs={"gang_join": True}, queue=queue, routing_key=queue
    )
    return str(res.id)

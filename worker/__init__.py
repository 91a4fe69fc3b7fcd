"""The worker service around the training job: it takes jobs from the queue and runs each, as
:mod:`worker.job.runner` in a child process, reporting to the database and to Prometheus.

=====================  ==========================================================================
module                 its one job
=====================  ==========================================================================
``broker``             the Celery app and its settings, queue names, ``enqueue_job`` (sending side)
``task``               the run task: claim, supervise the child process, re-queue or fail
``hooks``              Celery signal hooks: node name, /metrics server, reaper, registry, warm-shutdown preempt
``embedded``           a worker in a thread of the API process (embedded defaults)
``launcher``           ``python -m worker``: one worker process per GPU
``job_runner``         the child process: one job from the database through ``trainer.run.loop``
``monitor``            the child's heartbeat and cancel polling
``reporter``           training events -> database rows
``dispatch``           the outbox: queued jobs whose broker message never arrived or was lost
``reaper``             running jobs whose worker died (stale heartbeats)
``telemetry``          training-side Prometheus metrics of a job process
``metrics_server``     a worker's /metrics: multiprocess files merged with NVML readings
``nvml``               NVML access (GPU list, index, utilization and memory), no CUDA
``capacity``           what a worker can run, measured at its start (GPU, memory, cores, bandwidths)
``presence``           the worker's registry row: capacity, heartbeat
``admission``          does a job's plan fit a worker (at create and before the runner starts it)
``prometheus_dir``     the prometheus-client multiprocess directory, shared with the API's metrics
=====================  ==========================================================================

Start a worker with ``celery -A worker worker --pool solo ...`` or ``python -m worker
--gpus auto``. Importing this package (or :mod:`worker.broker`, which the API imports to send
jobs) registers no task and imports no torch; the attribute ``celery_app`` (alias ``app``, what
``celery -A`` looks up) loads the task and the worker hooks first.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("celery_app", "app"):
        from worker import hooks, task  # noqa: F401  (register the task and the signal hooks)
        from worker.broker import celery_app

        return celery_app
    raise AttributeError(f"module 'worker' has no attribute {name!r}")

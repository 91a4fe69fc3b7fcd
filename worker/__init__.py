"""The worker service (the layer above the job library): it takes jobs from the queue and runs each,
as :mod:`worker.job.runner` in a child process, reporting to the database and to Prometheus.

================================  ===============================================================
module                            its one job
================================  ===============================================================
``broker``                        the Celery app and its settings, queue names, ``enqueue_job``
``task``                          the run task: claim, supervise the child process, re-queue or fail
``requeue``                       what the task does once a job's child process has exited
``hooks``                         Celery signal hooks: node name, /metrics, reaper, registry, preempt
``embedded``                      a worker in a thread of the API process (embedded defaults)
``launcher``                      ``python -m worker``: one worker process per GPU or GPU group
``dispatch``                      the outbox: queued jobs whose broker message never arrived
``reaper``                        running jobs whose worker died (stale heartbeats)
``errors``, ``retry``             what a user may see of an error; retrying across database drops
``job/``                          the child process: ``runner`` (one job from the database through
                                  ``trainer.run.loop``), ``ranks`` (the peer ranks of a multi-GPU
                                  job), ``monitor`` (heartbeat, cancel polling), ``reporter`` (events
                                  -> rows), ``writer`` (rows written in order across outages),
                                  ``exits`` (its exit codes)
``metrics/``                      Prometheus: ``telemetry`` (a job's training steps), ``server`` (a
                                  worker's /metrics), ``nvml`` (GPUs, no CUDA), ``multiprocess``
                                  (the directory shared with the API's /metrics)
``capacity/``                     ``measure`` (what a worker can run, measured at its start),
                                  ``presence`` (its registry row and heartbeat), ``fit`` (does a
                                  job's plan fit a worker: at create and before the runner runs it)
================================  ===============================================================

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

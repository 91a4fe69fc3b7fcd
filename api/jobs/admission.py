"""Admission by capacity at job create: refuse a job whose plan fits no live worker of its queue.

A job on several ranks (``resources.gpus``) is first refused when no live worker runs jobs that large
(:func:`check_gpus`); its queue is then the one of its size (``worker.broker.queue_for_gpus``).
The candidates are the queue's live workers (:func:`store.worker_registry.live_workers`, heartbeat within
``worker_live_seconds``) with the capacity each measured at start; with none registered, the
configured default capacity (``ZENFLOW_DEFAULT_WORKER_*``, :func:`worker.capacity.measure.
default_capacity`). The check itself (:func:`worker.capacity.fit.refusal`) is the one the worker
repeats before it runs the job. A refusal is a 400 ``insufficient_capacity`` whose ``param`` names
the request field to change and whose message gives the numbers; it is raised before anything is
written. Planning builds the model on torch's meta device, so the first create imports torch in the
API process (once).
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from api.core.errors import APIError
from api.jobs.checks import request_loc
from store import worker_registry
from store.settings import Settings
from worker.capacity.fit import CODE, refusal
from worker.capacity.measure import WorkerCapacity, default_capacity

log = logging.getLogger(__name__)


def candidates(session: Session, queue: str, settings: Settings) -> list[tuple[str, WorkerCapacity]]:
    """(label, capacity) of the live workers of ``queue`` (``worker gpu0@host``), or of the default
    capacity when there are none."""
    found: list[tuple[str, WorkerCapacity]] = []
    for w in worker_registry.live_workers(session, queue, live_seconds=settings.worker_live_seconds):
        try:
            found.append((f"worker {w.name}", WorkerCapacity.model_validate(w.capacity)))
        except ValidationError as e:
            log.warning("worker %s: unreadable capacity, left out of admission: %s", w.name, e)
    if found:
        return found
    try:
        return [(f"the default worker (none registered on queue {queue})", default_capacity(settings))]
    except ValueError as e:
        raise APIError(503, f"Admission is misconfigured: {e}", code="server_misconfigured") from e


def check_gpus(session: Session, gpus: int, settings: Settings) -> None:
    """Refuse (400 on ``resources.gpus``, before anything is written) a job on more than one rank that
    no live worker runs: a worker consumes only the queue of its own job size (``worker_registry.gpus_per_job``),
    so a size no live worker has would wait forever. With no worker live at all, one GPU is admitted as
    always, more only where this process's own settings run them (``cpu_ranks`` and ``gpus_per_job``:
    the embedded server, whose worker may not have registered yet)."""
    if gpus <= 1:
        return
    sizes = worker_registry.live_job_sizes(session, live_seconds=settings.worker_live_seconds)
    if not sizes:
        if settings.cpu_ranks and settings.gpus_per_job >= gpus:
            return
        message = (
            f"No worker is live to run a job on {gpus} GPUs: start one with --gpus-per-job {gpus} "
            "or ask for resources.gpus 1"
        )
    elif gpus > sizes[-1]:
        message = (
            f"The job asks for {gpus} GPUs, more than any live worker runs: the largest jobs live "
            f"workers serve are {sizes[-1]} GPU{'s' if sizes[-1] > 1 else ''}"
        )
    elif gpus not in sizes:
        message = (
            f"The job asks for {gpus} GPUs and no live worker runs jobs of that size (a worker runs "
            f"jobs of exactly its --gpus-per-job): live workers run jobs of "
            f"{', '.join(map(str, sizes))} GPUs; ask for one of these or start a worker with "
            f"--gpus-per-job {gpus}"
        )
    else:
        return
    raise APIError(400, message, param="resources.gpus", code=CODE)


def check_capacity(
    session: Session,
    spec: Any,
    settings: Settings,
    *,
    queue: str,
    num_examples: int | None,
    hyperparameters_param: str,
) -> None:
    """Raise a 400 naming the field when ``spec`` (a checked trainer JobSpec) fits no candidate of ``queue``."""
    try:
        refused = refusal(spec, candidates(session, queue, settings), num_examples=num_examples)
    except ValueError as e:  # the model's config cannot be built on the meta device (UnknownModelError too)
        raise APIError(
            400, f"Cannot plan model {spec.model!r}: {e}", param="model", code="invalid_model"
        ) from e
    if refused is None:
        return
    loc = request_loc(refused.loc, hyperparameters_param)
    raise APIError(400, refused.message, param=".".join(str(p) for p in loc) or None, code=CODE)

"""Admission by capacity at job create: the job is resolved for the first live worker of its queue whose
machine its plan fits (:func:`admit`), and refused when it fits none.

A job on several ranks (``resources.gpus``) is first refused when no worker runs jobs of that size
(:func:`check_gpus`, the message listing the sizes served); its queue is then the one of its size
(``worker.broker.queue_for_gpus``). A job on several nodes (``resources.nodes`` M) is refused when
fewer than M live workers of its queue and size could form its gang (:func:`check_nodes`).
The candidates are the queue's live workers (:func:`store.worker_registry.live_workers`, heartbeat within
``worker_live_seconds``) with the capacity each measured at start; with none registered, the
configured default capacity (``ZENFLOW_DEFAULT_WORKER_*``, :func:`worker.capacity.measure.
default_capacity`). The check itself is :func:`worker.capacity.fit.admit`; a worker whose machine differs
from the one the job was resolved for resolves it again before it runs it. A refusal is a 400 ``insufficient_capacity`` whose ``param`` names
the request field to change and whose message gives the numbers; it is raised before anything is
written. Planning builds the model on torch's meta device, so the first create imports torch in the
API process (once). A job entering its queue (a create, a resume) is also held to its team's quotas
(:func:`admit_quotas`).
"""

from __future__ import annotations

import logging
import math

from pydantic import ValidationError
from sqlalchemy.orm import Session

from api.core.errors import APIError
from api.jobs.checks import request_loc
from store import quotas, worker_registry
from store.settings import Settings
from trainer.resolve import Counts
from trainer.spec import JobSpec
from worker.capacity.fit import CODE, Admitted, Refusal, admit
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


def served_sizes(live: list[int], settings: Settings) -> list[int]:
    """The job sizes (GPUs per job) this service runs now, ascending: one GPU always (admitted with no
    worker of that size live, as ever), those the ``live`` workers run (``worker_registry.live_job_sizes``),
    and while none is live, the size this process's own embedded worker runs (``cpu_ranks`` and
    ``gpus_per_job``: it may not have registered yet)."""
    sizes = set(live)
    if not sizes and settings.cpu_ranks:
        sizes.add(settings.gpus_per_job)
    return sorted(sizes | {1})


def check_gpus(session: Session, gpus: int, settings: Settings) -> None:
    """Refuse (400 on ``resources.gpus``, before anything is written) a job on more than one rank of a
    size no worker runs: a worker consumes only the queue of its own job size, so such a job would wait
    forever. The message lists the sizes served (:func:`served_sizes`): "No worker serves 3 GPUs per
    job; sizes served: 1, 2. ..."."""
    if gpus <= 1:
        return
    live = worker_registry.live_job_sizes(session, live_seconds=settings.worker_live_seconds)
    sizes = served_sizes(live, settings)
    if gpus in sizes:
        return
    message = (
        f"No worker serves {gpus} GPUs per job{'' if live else ' (no worker is live)'}; sizes served: "
        f"{', '.join(map(str, sizes))}. Ask for one of these in resources.gpus, or start a worker with "
        f"--gpus-per-job {gpus}"
    )
    raise APIError(400, message, param="resources.gpus", code=CODE)


def check_nodes(session: Session, nodes: int, gpus: int, queue: str, settings: Settings) -> None:
    """Refuse (400 on ``resources.nodes``, before anything is written) a job on ``nodes`` > 1 worker
    hosts when fewer live workers of ``queue`` run jobs of ``gpus`` ranks: its gang (store.gang) could
    never form. Each member is one worker; M workers of one host count as M nodes."""
    if nodes <= 1:
        return
    live = [
        w
        for w in worker_registry.live_workers(session, queue, live_seconds=settings.worker_live_seconds)
        if w.gpus_per_job == gpus
    ]
    if len(live) >= nodes:
        return
    message = (
        f"No set of live workers can run {nodes} nodes x {gpus} GPUs: queue {queue} has {len(live)} live "
        f"worker(s) of {gpus} GPU(s) per job. Ask for at most {max(1, len(live))} in resources.nodes, or "
        f"start more workers with --gpus-per-job {gpus} on that queue"
    )
    raise APIError(400, message, param="resources.nodes", code=CODE)


def admit_job(
    session: Session,
    spec: JobSpec,
    settings: Settings,
    *,
    queue: str,
    counts: Counts,
    hyperparameters_param: str,
) -> Admitted:
    """The job resolved for the first candidate of ``queue`` it fits; a 400 naming the field when it fits none."""
    try:
        decided = admit(spec, candidates(session, queue, settings), counts, reason="the job was created")
    except ValueError as e:  # the model's config cannot be built on the meta device (UnknownModelError too)
        raise APIError(
            400, f"Cannot plan model {spec.model!r}: {e}", param="model", code="invalid_model"
        ) from e
    if isinstance(decided, Refusal):
        loc = request_loc(decided.loc, hyperparameters_param)
        raise APIError(400, decided.message, param=".".join(str(p) for p in loc) or None, code=CODE)
    return decided


def admit_quotas(session: Session, team_id: str, settings: Settings) -> None:
    """The team's quotas (store.quotas) for a job entering its queue (a create, a resume) as API errors:
    429 ``quota_exceeded`` for limits that free up by themselves (with ``Retry-After`` when known), 400
    for hard ones; ``param`` names the quota. Call under the team's row lock (``quotas.lock_team``)."""
    try:
        quotas.admit_job(session, team_id, settings)
    except quotas.QuotaExceeded as exc:
        headers = {"Retry-After": str(math.ceil(exc.retry_after))} if exc.retry_after is not None else None
        raise APIError(
            exc.status_code, exc.message, param=exc.quota, code="quota_exceeded", headers=headers
        ) from exc

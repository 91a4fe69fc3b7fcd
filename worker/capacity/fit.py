"""Does a job fit a worker? The one check behind admission at create (:mod:`api.jobs.admission`) and the
worker's re-check before it runs a job (:mod:`worker.job.runner`).

The job's plan (:func:`trainer.plan.planner.plan_job`) is computed for each candidate worker's machine
(:func:`worker.capacity.measure.to_machine`; workers of the same capacity planned once). When it fits
none, the refusal names the request field to change (the plan problem's location) and its message
gives the numbers, against the candidate that comes closest (fewest problems, then the most GPU and
host memory), prefixed by that worker's name and capacity; the re-check of a worker against itself
words it the same way, so a job refused at start reads like one refused at create.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select

from store import worker_registry
from store.db import session_scope
from store.orm import File, FineTuningJob
from trainer.plan.gpus import Machine
from trainer.plan.records import Problem
from worker.capacity.measure import WorkerCapacity, local_capacity, to_machine
from worker.retry import DatabaseUnavailable, retry_db

log = logging.getLogger("zenflow.job_runner")

#: Error code of a job that fits no worker (the API's 400 and a failed job's ``error.code``).
CODE = "insufficient_capacity"


@dataclass(frozen=True)
class Refusal:
    """Why a job fits no candidate worker: the field to change (``loc``, as the job spec spells it)
    and a message with the numbers."""

    loc: tuple[str | int, ...]
    message: str

    @property
    def param(self) -> str | None:
        return ".".join(str(p) for p in self.loc) or None


def refusal(
    spec: Any, candidates: Sequence[tuple[str, WorkerCapacity]], *, num_examples: int | None = None
) -> Refusal | None:
    """None when ``spec``'s plan fits one of ``candidates`` ((label, capacity), at least one; the label
    names the worker in the message: ``worker gpu0@host``);
    else the refusal against the one that comes closest. Raises what :func:`trainer.plan.planner.plan_job`
    raises for a model whose config cannot be built."""
    from trainer.plan.planner import plan_job

    if not candidates:
        raise ValueError("no candidate worker to plan for")
    planned: dict[Machine, tuple[str, WorkerCapacity, Any]] = {}
    for name, capacity in candidates:
        machine = to_machine(capacity)
        if machine in planned:
            continue
        plan = plan_job(spec, machine, num_examples=num_examples, advise=False)
        if plan.fits:
            return None
        planned[machine] = (name, capacity, plan)

    def closeness(machine: Machine) -> tuple[int, int, int]:
        return len(planned[machine][2].problems), -machine.gpu_memory_bytes, -machine.host_memory_bytes

    closest = min(planned, key=closeness)
    name, capacity, _ = planned[closest]
    # The fixes are planned for the closest worker only (each one is a plan: ~10 per machine).
    plan = plan_job(spec, closest, num_examples=num_examples)
    problems = list(plan.problems) or [Problem((), "the plan does not fit")]
    reasons = "; ".join(message for _, message in problems)
    who = (
        name
        if len(candidates) == 1
        else f"any of the {len(candidates)} live workers of its queue; the closest is {name}"
    )
    return Refusal(tuple(problems[0][0]), f"The job does not fit {who} ({capacity.describe()}): {reasons}")


def _stored_capacity(url: str, job_id: str, worker: str) -> tuple[dict[str, Any] | None, int | None]:
    """The capacity ``worker`` registered (None: no row) and the job's training-example count."""
    with session_scope(url) as s:
        row = worker_registry.get(s, worker)
        num_examples = s.scalar(
            select(File.num_examples)
            .join(FineTuningJob, FineTuningJob.training_file_id == File.id)
            .where(FineTuningJob.id == job_id)
        )
        return (dict(row.capacity) if row is not None else None), num_examples


def recheck(url: str, job_id: str, worker: str, spec: Any, *, window: float) -> Refusal | None:
    """The worker's re-check before it runs ``job_id``: the job's plan against the capacity worker
    ``worker`` registered (measured here when it has none: a job process run by hand, or one started
    before its worker's measurement was in). None when it fits, and when it cannot be told (the
    database away for ``window``, a model the plan cannot build): the run then goes ahead as before."""
    try:
        stored, num_examples = retry_db(
            lambda: _stored_capacity(url, job_id, worker),
            window=window,
            what=f"job {job_id}: capacity re-check",
        )
    except DatabaseUnavailable as e:
        log.warning("job %s: capacity not re-checked: %s", job_id, e)
        return None
    try:
        capacity = WorkerCapacity.model_validate(stored) if stored is not None else local_capacity()
    except ValidationError:  # a row written by another version: what this process sees instead
        capacity = local_capacity()
    try:
        return refusal(spec, [(f"worker {worker}", capacity)], num_examples=num_examples or None)
    except ValueError as e:
        log.warning("job %s: capacity not re-checked: cannot plan the model: %s", job_id, e)
        return None

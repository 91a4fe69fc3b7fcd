"""Does a job fit a worker? Admission at create (:mod:`api.jobs.admission`: the job is resolved for the
first candidate worker whose machine its plan fits, :func:`admit`) and the runner's check before a run
on a worker whose machine differs from the one the job was resolved for (:mod:`worker.job.runner`).

Workers of the same capacity are planned once (:func:`worker.capacity.measure.to_machine`). When the
job fits none, the refusal names the request field to change (the plan problem's location) and its
message gives the numbers, against the candidate that comes closest (fewest problems, then the most GPU
and host memory), prefixed by that worker's name and capacity; a runner's refusal on its own worker is
worded the same way, so a job refused at start reads like one refused at create.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from contract.job import Resolution
from store import worker_registry
from store.db import session_scope
from trainer.plan.gpus import Machine
from trainer.plan.records import Plan, Problem
from trainer.resolve import Counts, plan_spec, resolve
from trainer.spec import JobSpec
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


@dataclass(frozen=True)
class Admitted:
    """The job's resolution for the first candidate it fits, and the plan it took its choices from."""

    resolution: Resolution
    plan: Plan
    worker: str


def admit(
    spec: JobSpec, candidates: Sequence[tuple[str, WorkerCapacity]], counts: Counts, *, reason: str
) -> Admitted | Refusal:
    """The job resolved for the first of ``candidates`` ((label, capacity), at least one; the label names
    the worker in a message: ``worker gpu0@host``) whose machine its plan fits; else the refusal against
    the one that comes closest. Raises what :func:`trainer.plan.planner.plan_job` raises for a model
    whose config cannot be built."""
    if not candidates:
        raise ValueError("no candidate worker to plan for")
    planned: dict[Machine, tuple[str, WorkerCapacity, Plan]] = {}
    for name, capacity in candidates:
        machine = to_machine(capacity)
        if machine in planned:
            continue
        plan = plan_spec(
            spec, machine, num_examples=counts.num_examples, num_tokens=counts.num_tokens, advise=False
        )
        if plan.fits:
            resolution, _ = resolve(spec, machine, counts, at="create", reason=reason, plan=plan)
            return Admitted(resolution, plan, name)
        planned[machine] = (name, capacity, plan)
    return _closest_refusal(spec, planned, counts, len(candidates))


def _closest_refusal(
    spec: JobSpec,
    planned: dict[Machine, tuple[str, WorkerCapacity, Plan]],
    counts: Counts,
    candidates: int,
) -> Refusal:
    def closeness(machine: Machine) -> tuple[int, int, int]:
        return len(planned[machine][2].problems), -machine.gpu_memory_bytes, -machine.host_memory_bytes

    closest = min(planned, key=closeness)
    name, capacity, _ = planned[closest]
    # The fixes are planned for the closest worker only (each one is a plan: ~10 per machine).
    plan = plan_spec(spec, closest, num_examples=counts.num_examples, num_tokens=counts.num_tokens)
    problems = list(plan.problems) or [Problem((), "the plan does not fit")]
    reasons = "; ".join(message for _, message in problems)
    who = (
        name
        if candidates == 1
        else f"any of the {candidates} live workers of its queue; the closest is {name}"
    )
    return Refusal(tuple(problems[0][0]), f"The job does not fit {who} ({capacity.describe()}): {reasons}")


def refusal_here(spec: JobSpec, worker: str, capacity: WorkerCapacity, counts: Counts) -> Refusal | None:
    """The refusal of a job that does not fit this worker (None: it fits), worded as admission's."""
    plan = plan_spec(
        spec,
        to_machine(capacity),
        num_examples=counts.num_examples,
        num_tokens=counts.num_tokens,
        advise=False,
    )
    if plan.fits:
        return None
    return _closest_refusal(spec, {to_machine(capacity): (f"worker {worker}", capacity, plan)}, counts, 1)


def _registered(url: str, worker: str) -> WorkerCapacity | None:
    with session_scope(url) as s:
        row = worker_registry.get(s, worker)
        return WorkerCapacity.model_validate(row.capacity) if row is not None else None


def worker_capacity(url: str, worker: str, *, window: float) -> WorkerCapacity:
    """The capacity ``worker`` registered (measured here when it has none, or one this version cannot
    read: a job process run by hand, or started before its worker's measurement was in; or the database
    away for ``window``)."""
    try:
        stored = retry_db(lambda: _registered(url, worker), window=window, what=f"{worker}: capacity")
    except (DatabaseUnavailable, ValidationError) as e:
        log.warning("%s: registered capacity unavailable (%s); measuring here", worker, e)
        stored = None
    return stored if stored is not None else local_capacity()

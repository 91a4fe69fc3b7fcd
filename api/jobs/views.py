"""The read side of fine-tuning jobs: how job, event, checkpoint and step-metric rows become API
objects, the SQL of a job's ``queue_position``, and the prebuilt read statements the job and event
routers run."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Select, bindparam, select
from sqlalchemy.orm import Session, aliased

from api.core.errors import not_found
from api.core.pagination import after_clause
from api.jobs.public_paths import PublicPaths
from api.schemas import FineTuningJobObject, JobCheckpointObject, JobEventObject, StepMetric, unix
from contract.job import JobRequest, Resolution
from store.fairshare import fair_order
from store.jobs import PENDING, lock_job
from store.orm import FineTuningJob, JobCheckpoint, JobEvent, JobStatus, JobStepMetric, as_utc

# --- queue position ----------------------------------------------------------------------------------

# A waiting job's ``queue_position`` (1 = the next job its queue's workers take, all teams counted;
# NULL unless waiting) is its rank by fair share (store.fairshare.fair_order), the order the workers'
# claim (store.jobs.claim_next) follows.

#: The one job's queue (its id is the statement's ``job_id``) while it waits, so that retrieving a job
#: ranks that queue alone, and nothing for a job that does not wait (NULL matches no queue).
_RANKED = aliased(FineTuningJob, name="ranked_job")
_JOB_QUEUE = (
    select(_RANKED.queue)
    .where(_RANKED.id == bindparam("job_id"), _RANKED.status.in_(PENDING))
    .scalar_subquery()
)
_JOB_QUEUE_RANKS = fair_order(_JOB_QUEUE, name="job_queue_ranks")

#: Every waiting job ranked once per queue, joined to a page, so a list is one query however many of
#: its jobs wait.
_WAITING_RANKS = fair_order(name="waiting_ranks")

#: What the job object is built from (a Row of these reads like the ORM object): no identity map or
#: instance state to set up per row.
JOB_COLUMNS = (
    FineTuningJob.id,
    FineTuningJob.created_at,
    FineTuningJob.finished_at,
    FineTuningJob.started_at,
    FineTuningJob.model,
    FineTuningJob.fine_tuned_model,
    FineTuningJob.team_id,
    FineTuningJob.status,
    FineTuningJob.request,
    FineTuningJob.resolutions,
    FineTuningJob.training_file_id,
    FineTuningJob.validation_file_id,
    FineTuningJob.trained_tokens,
    FineTuningJob.result_files,
    FineTuningJob.error,
    FineTuningJob.seed,
    FineTuningJob.suffix,
    FineTuningJob.user_metadata,
    FineTuningJob.integrations,
    FineTuningJob.cancel_requested,
    FineTuningJob.pause_requested,
    FineTuningJob.global_step,
    FineTuningJob.total_steps,
    FineTuningJob.attempts,
    FineTuningJob.output_dir,
)


def queue_position(session: Session, job: FineTuningJob) -> int | None:
    """The queue position of one job already loaded (create, cancel)."""
    if job.status not in PENDING:
        return None
    ranks = fair_order(job.queue, name="queue_ranks")
    pos = session.scalar(select(ranks.c.pos).where(ranks.c.job_id == job.id))
    return int(pos) if pos is not None else None


# --- prebuilt read statements ------------------------------------------------------------------------

# Built once (bound parameters): building a select of two dozen columns and its cache key costs more
# per request than running it.

#: The list cursor's job: ``job_id`` -> its team and creation time.
JOB_CURSOR = select(FineTuningJob.team_id, FineTuningJob.created_at).where(
    FineTuningJob.id == bindparam("job_id")
)
#: One team's job (``job_id``, ``team_id``) as ``JOB_COLUMNS`` with its ``queue_position``.
GET_JOB = (
    select(*JOB_COLUMNS, _JOB_QUEUE_RANKS.c.pos.label("queue_position"))
    .outerjoin(_JOB_QUEUE_RANKS, _JOB_QUEUE_RANKS.c.job_id == FineTuningJob.id)
    .where(FineTuningJob.id == bindparam("job_id"), FineTuningJob.team_id == bindparam("team_id"))
)


@functools.cache
def list_statement(with_status: bool, with_cursor: bool) -> Select[Any]:
    """A page of a team's jobs, newest first, with their queue positions (one query)."""
    stmt = (
        select(*JOB_COLUMNS, _WAITING_RANKS.c.pos)
        .outerjoin(_WAITING_RANKS, _WAITING_RANKS.c.job_id == FineTuningJob.id)
        .where(FineTuningJob.team_id == bindparam("team_id"))
    )
    if with_status:
        stmt = stmt.where(FineTuningJob.status == bindparam("status"))
    if with_cursor:
        stmt = stmt.where(
            after_clause(
                (FineTuningJob.created_at, FineTuningJob.id),
                (bindparam("after_created_at"), bindparam("after_id")),
                descending=True,
            )
        )
    return stmt.order_by(FineTuningJob.created_at.desc(), FineTuningJob.id.desc()).limit(bindparam("limit"))


def get_team_job(session: Session, team_id: str, job_id: str, *, lock: bool = False) -> FineTuningJob:
    job = lock_job(session, job_id) if lock else session.get(FineTuningJob, job_id)
    if job is None or job.team_id != team_id:
        raise not_found("fine-tuning job", job_id, param="fine_tuning_job_id")
    return job


# --- serialization -----------------------------------------------------------------------------------


def estimated_finish(job: Any) -> int | None:
    started = as_utc(job.started_at)
    if (
        job.status != JobStatus.running.value
        or started is None
        or not job.total_steps
        or job.global_step <= 0
    ):
        return None
    elapsed = (datetime.now(UTC) - started).total_seconds()
    return int(started.timestamp() + elapsed * job.total_steps / job.global_step)


def _error(job: Any, paths: PublicPaths | None) -> dict[str, Any] | None:
    if not job.error:
        return None
    e = job.error
    message = str(e.get("message") or "The job failed")
    return {
        "code": str(e.get("code") or "error"),
        "message": paths.text(message) if paths is not None else message,
        "param": e.get("param"),
    }


#: OpenAI's hyperparameters, first in the job object's ``hyperparameters``.
OPENAI_HYPERPARAMETERS = ("n_epochs", "batch_size", "learning_rate_multiplier")


def _current(job: Any) -> Resolution | None:
    resolutions: list[Resolution] = job.resolutions or []
    return resolutions[-1] if resolutions else None


def job_hyperparameters(request: JobRequest, current: Resolution | None) -> dict[str, Any]:
    """What the job runs with: OpenAI's three first, then every other hyperparameter: the resolved values
    once the job is resolved (contract.hyperparameters.ResolvedHyperparameters: learning_rate,
    max_seq_length, lora, warmup_steps, total_steps, ...), the request's (``auto`` where it left them)
    before."""
    hp: dict[str, Any] = dict.fromkeys(OPENAI_HYPERPARAMETERS, "auto")
    if current is None:
        hp.update(request.hyperparameters.model_dump(mode="json", exclude_unset=True))
    else:
        hp.update(current.job.hyperparameters.model_dump(mode="json"))
    return hp


def job_method(request: JobRequest, current: Resolution | None, hp: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``method``: its type, and the hyperparameters under it (DPO's ``beta`` among them; a
    reinforcement job's own settings and ``eval_interval``, its grader beside them)."""
    method = current.job.method if current is not None else request.method
    own = method.model_dump(mode="json", exclude={"type", "grader", "judges"})
    inner: dict[str, Any] = {"hyperparameters": {**hp, **own}}
    if method.type == "reinforcement":
        inner["hyperparameters"]["eval_interval"] = hp.get("eval_every")
        inner["grader"] = method.model_dump(mode="json", include={"grader"}, exclude_unset=True)["grader"]
    return {"type": method.type, method.type: inner}


def resolution_objects(resolutions: list[Resolution]) -> list[dict[str, Any]]:
    """Each decision of the job's settings as the job object shows it, with what it changed."""
    out = []
    for i, r in enumerate(resolutions):
        machine = r.machine or {}
        planned_for = (
            f"{machine.get('gpu_name')}: {machine.get('host_memory_bytes', 0) / 2**30:.1f} GiB host, "
            f"{machine.get('cores')} cores"
            if machine
            else None
        )
        out.append(
            {
                "at": r.at,
                "reason": r.reason,
                "decided_at": unix(r.decided_at) or 0,
                "planned_for": planned_for,
                "plan": r.plan.summary if r.plan is not None else None,
                "changes": r.job.changes(resolutions[i - 1].job) if i else {},
            }
        )
    return out


def job_dict(job: Any, position: int | None, paths: PublicPaths | None = None) -> dict[str, Any]:
    """The job object's fields from a job row (ORM object or a Row of ``JOB_COLUMNS``), as plain data:
    validated once, as a whole response, by the endpoint's response model. With ``paths``, server paths
    in the error's message become public names (a job's error may quote its model folder)."""
    request: JobRequest = job.request
    current = _current(job)
    hp = job_hyperparameters(request, current)
    settings = current.job if current is not None else request
    return {
        "id": job.id,
        "created_at": unix(job.created_at) or 0,
        "finished_at": unix(job.finished_at),
        "model": job.model,
        "fine_tuned_model": job.fine_tuned_model,
        "organization_id": job.team_id,
        "status": job.status,
        "hyperparameters": hp,
        "method": job_method(request, current, hp),
        "training_file": job.training_file_id,
        "validation_file": job.validation_file_id,
        "trained_tokens": job.trained_tokens,
        "result_files": list(job.result_files or []),
        "error": _error(job, paths),
        "seed": job.seed,
        "suffix": job.suffix,
        "user_provided_suffix": job.suffix,
        "metadata": job.user_metadata,
        "estimated_finish": estimated_finish(job),
        "integrations": list(job.integrations or []),
        "engine": settings.engine.model_dump(mode="json"),
        "resources": settings.resources.model_dump(mode="json"),
        "sources": dict(current.job.sources) if current is not None else {},
        "resolutions": resolution_objects(job.resolutions or []),
        "queue_position": position,
        "cancel_requested": job.cancel_requested,
        "pause_requested": job.pause_requested,
        "progress": {
            "step": job.global_step or 0,
            "total_steps": planned_total_steps(job, hp),
            "attempts": job.attempts or 0,
        },
    }


def planned_total_steps(job: Any, hp: dict[str, Any]) -> int | None:
    """The run's step count once it has started, else the one resolved at create (a queued job's
    ``hyperparameters.total_steps``); None when neither is known."""
    if job.total_steps:
        return int(job.total_steps)
    planned = hp.get("total_steps")
    return planned if isinstance(planned, int) and not isinstance(planned, bool) and planned > 0 else None


def queued_message(queue: str, capacities: Sequence[Any]) -> str:
    """The create's queue event: ``Job queued on gpu-default``; where every worker that may run it
    (the queue's live workers, else the default worker assumed) has no GPU, that it trains on a CPU
    (the queue's name is a configured label, ``gpu-default`` on a CPU box too)."""
    if capacities and all(getattr(c, "device_type", None) == "cpu" for c in capacities):
        return f"Job queued on {queue} (its workers have no GPU: it trains on the CPU)"
    return f"Job queued on {queue}"


def job_object(job: Any, position: int | None, paths: PublicPaths | None = None) -> FineTuningJobObject:
    """The API object of a job row; ``position`` from ``GET_JOB``, a list's ranks or ``queue_position()``."""
    return FineTuningJobObject.model_validate(job_dict(job, position, paths))


def job_out(session: Session, job: FineTuningJob, paths: PublicPaths | None = None) -> FineTuningJobObject:
    """The API object of a job already loaded, with its queue position (create, cancel, replays)."""
    return job_object(job, queue_position(session, job), paths)


def event_object(ev: JobEvent, paths: PublicPaths) -> JobEventObject:
    """The API object of an event row; server paths in its message and data become public names
    (api.jobs.public_paths)."""
    level = {"warning": "warn", "critical": "error", "debug": "info"}.get(ev.level, ev.level)
    return JobEventObject(
        id=ev.id,
        created_at=unix(ev.created_at) or 0,
        level=level if level in ("info", "warn", "error") else "info",  # type: ignore[arg-type]
        message=paths.text(ev.message),
        type=ev.type if ev.type in ("message", "metrics") else "message",  # type: ignore[arg-type]
        data=paths.data(ev.data),
    )


def checkpoint_object(ck: JobCheckpoint) -> JobCheckpointObject:
    metrics = dict(ck.metrics or {})
    metrics.setdefault("step", ck.step_number)
    return JobCheckpointObject(
        id=ck.id,
        created_at=unix(ck.created_at) or 0,
        fine_tuned_model_checkpoint=ck.fine_tuned_model_checkpoint,
        fine_tuning_job_id=ck.job_id,
        step_number=ck.step_number,
        metrics=metrics,  # type: ignore[arg-type]
    )


def step_metric_object(r: JobStepMetric) -> StepMetric:
    return StepMetric(
        step=r.step,
        created_at=unix(r.created_at) or 0,
        train_loss=r.train_loss,
        valid_loss=r.valid_loss,
        lr=r.lr,
        tokens_per_second=r.tokens_per_second,
        step_seconds=r.step_seconds or 0.0,
        stall_seconds=r.stall_seconds or 0.0,
        stall_fraction=r.stall_fraction or 0.0,
        gpu_utilization=r.gpu_utilization,
        cpu_optimizer_seconds=r.cpu_optimizer_seconds or 0.0,
        bytes_device_to_host=r.bytes_device_to_host or 0,
        bytes_host_to_device=r.bytes_host_to_device or 0,
        method_metrics=r.method_metrics,
    )

"""``/v1/fine_tuning/jobs``: create (idempotent), list, retrieve, cancel, events (JSON or SSE),
checkpoints, and our per-step ``metrics`` extra."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import secrets
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from sqlalchemy import Select, bindparam, case, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased
from starlette.concurrency import run_in_threadpool

from api import integration
from api.auth import Principal
from api.deps import SettingsDep, TeamDep, run_db
from api.errors import APIError, error_responses, not_found, validation_error
from api.pagination import DEFAULT_LIMIT, MAX_LIMIT, after_clause, page
from api.schemas import FineTuningJob as JobOut
from api.schemas import (
    HyperparametersIn,
    JobCheckpoint,
    JobCreate,
    ListObject,
    StepMetric,
    unix,
)
from api.schemas import JobEvent as EventOut
from store.ids import new_id
from store.jobs import add_event, lock_job, mark_dispatched, set_status
from store.models import File, FineTuningJob, JobEvent, JobStatus, JobStepMetric, as_utc
from store.models import JobCheckpoint as CheckpointRow
from store.settings import Settings

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"], responses=error_responses(401, 503))

PENDING = (JobStatus.validating_files.value, JobStatus.queued.value)


# --- serialization -----------------------------------------------------------------------------------


def _queue_position_column() -> Any:
    """SQL for one job row's ``queue_position``: 1 for the next job the queue's workers take, counted
    over all teams (FIFO by creation: 1 + the waiting jobs of its queue created before it); NULL
    unless the job is waiting. A correlated count: right for one row (retrieve, create, cancel)."""
    ahead = aliased(FineTuningJob)
    n_ahead = (
        select(func.count())
        .select_from(ahead)
        .where(
            ahead.queue == FineTuningJob.queue,
            ahead.status.in_(PENDING),
            ahead.created_at < FineTuningJob.created_at,
        )
        .correlate(FineTuningJob)
        .scalar_subquery()
    )
    return case((FineTuningJob.status.in_(PENDING), n_ahead + 1), else_=None).label("queue_position")


QUEUE_POSITION = _queue_position_column()

#: The same figure for a page of jobs: every waiting job ranked once per queue (a window function; rank
#: = 1 + the jobs of the partition strictly earlier, ties share a position, as the count above), joined
#: to the page, so a list is one query however many of its jobs wait.
_WAITING_RANKS = (
    select(
        FineTuningJob.id.label("job_id"),
        func.rank().over(partition_by=FineTuningJob.queue, order_by=FineTuningJob.created_at).label("pos"),
    )
    .where(FineTuningJob.status.in_(PENDING))
    .subquery("waiting_ranks")
)

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
    FineTuningJob.hyperparameters,
    FineTuningJob.resolved_hyperparameters,
    FineTuningJob.training_file_id,
    FineTuningJob.validation_file_id,
    FineTuningJob.trained_tokens,
    FineTuningJob.result_files,
    FineTuningJob.error,
    FineTuningJob.seed,
    FineTuningJob.suffix,
    FineTuningJob.user_metadata,
    FineTuningJob.engine,
    FineTuningJob.cancel_requested,
    FineTuningJob.global_step,
    FineTuningJob.total_steps,
    FineTuningJob.attempts,
    FineTuningJob.output_dir,
)


def queue_position(session: Session, job: FineTuningJob) -> int | None:
    """The queue position of one job already loaded (create, cancel)."""
    if job.status not in PENDING:
        return None
    pos = session.scalar(select(QUEUE_POSITION).where(FineTuningJob.id == job.id))
    return int(pos) if pos is not None else None


def estimated_finish(job: Any) -> int | None:
    started = as_utc(job.started_at)
    if job.status != JobStatus.running.value or started is None or not job.total_steps or job.global_step <= 0:
        return None
    elapsed = (datetime.now(UTC) - started).total_seconds()
    return int(started.timestamp() + elapsed * job.total_steps / job.global_step)


def _error(job: Any) -> dict[str, Any] | None:
    if not job.error:
        return None
    e = job.error
    return {"code": str(e.get("code") or "error"), "message": str(e.get("message") or "The job failed"),
            "param": e.get("param")}


def job_dict(job: Any, position: int | None) -> dict[str, Any]:
    """The job object's fields from a job row (ORM object or a Row of ``JOB_COLUMNS``), as plain data:
    validated once, as a whole response, by the endpoint's response model."""
    hp = {"n_epochs": "auto", "batch_size": "auto", "learning_rate_multiplier": "auto"}
    hp.update({k: v for k, v in (job.hyperparameters or {}).items() if k in hp})
    hp.update({k: v for k, v in (job.resolved_hyperparameters or {}).items() if k in hp and v is not None})
    return {
        "id": job.id,
        "created_at": unix(job.created_at) or 0,
        "finished_at": unix(job.finished_at),
        "model": job.model,
        "fine_tuned_model": job.fine_tuned_model,
        "organization_id": job.team_id,
        "status": job.status,
        "hyperparameters": hp,
        "method": {"type": "supervised", "supervised": {"hyperparameters": hp}},
        "training_file": job.training_file_id,
        "validation_file": job.validation_file_id,
        "trained_tokens": job.trained_tokens,
        "result_files": list(job.result_files or []),
        "error": _error(job),
        "seed": job.seed,
        "suffix": job.suffix,
        "user_provided_suffix": job.suffix,
        "metadata": job.user_metadata,
        "estimated_finish": estimated_finish(job),
        "engine": job.engine or {},
        "queue_position": position,
        "cancel_requested": job.cancel_requested,
        "progress": {"step": job.global_step or 0, "total_steps": job.total_steps, "attempts": job.attempts or 0},
        "output_dir": job.output_dir,
    }


def job_object(job: Any, position: int | None) -> JobOut:
    """The API object of a job row; ``position`` from ``QUEUE_POSITION`` or ``queue_position()``."""
    return JobOut.model_validate(job_dict(job, position))


def event_object(ev: JobEvent) -> EventOut:
    level = {"warning": "warn", "critical": "error", "debug": "info"}.get(ev.level, ev.level)
    return EventOut(
        id=ev.id,
        created_at=unix(ev.created_at) or 0,
        level=level if level in ("info", "warn", "error") else "info",  # type: ignore[arg-type]
        message=ev.message,
        type=ev.type if ev.type in ("message", "metrics") else "message",  # type: ignore[arg-type]
        data=ev.data,
    )


def checkpoint_object(ck: CheckpointRow) -> JobCheckpoint:
    metrics = dict(ck.metrics or {})
    metrics.setdefault("step", ck.step_number)
    return JobCheckpoint(
        id=ck.id,
        created_at=unix(ck.created_at) or 0,
        fine_tuned_model_checkpoint=ck.fine_tuned_model_checkpoint,
        fine_tuning_job_id=ck.job_id,
        step_number=ck.step_number,
        metrics=metrics,  # type: ignore[arg-type]
        path=ck.path,
    )


def get_team_job(session: Session, team_id: str, job_id: str, *, lock: bool = False) -> FineTuningJob:
    job = lock_job(session, job_id) if lock else session.get(FineTuningJob, job_id)
    if job is None or job.team_id != team_id:
        raise not_found("fine-tuning job", job_id, param="fine_tuning_job_id")
    return job


def _job_out(session: Session, job: FineTuningJob) -> JobOut:
    return job_object(job, queue_position(session, job))


# --- create ------------------------------------------------------------------------------------------


def _request_hash(body: JobCreate) -> str:
    canon = json.dumps(body.model_dump(mode="json", exclude_none=True), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def _hyperparameters(body: JobCreate) -> tuple[dict[str, Any], str]:
    """The requested hyperparameters and where they were given (for error params)."""
    top = body.hyperparameters
    nested = body.method.supervised.hyperparameters if body.method and body.method.supervised else None
    if top is not None and nested is not None and top != nested:
        raise APIError(
            400,
            "Give hyperparameters either at the top level or in method.supervised.hyperparameters, not both",
            param="hyperparameters", code="invalid_value",
        )
    where = "hyperparameters" if top is not None or nested is None else "method.supervised.hyperparameters"
    return (top or nested or HyperparametersIn()).model_dump(mode="json"), where


def _engine(body: JobCreate) -> dict[str, Any]:
    """The engine settings the request gives (unset fields keep the trainer's defaults)."""
    if not body.engine:
        return {}
    from offload.config import EngineConfig

    try:
        cfg = EngineConfig.model_validate(body.engine)
    except ValidationError as exc:
        raise validation_error(exc.errors(), prefix="engine", fields=EngineConfig.model_fields) from exc
    return cfg.model_dump(mode="json", exclude_unset=True)


def _check_file(session: Session, team_id: str, file_id: str, param: str) -> File:
    row = session.get(File, file_id)
    if row is None or row.team_id != team_id:
        raise APIError(400, f"Invalid {param}: no such file {file_id!r}", param=param, code="file_not_found")
    if row.purpose != "fine-tune":
        raise APIError(400, f"Invalid {param}: file {file_id} has purpose {row.purpose!r}, not 'fine-tune'",
                       param=param, code="invalid_file_purpose")
    if row.status != "processed":
        raise APIError(400, f"Invalid {param}: file {file_id} is not ready ({row.status})", param=param,
                       code="file_not_ready")
    return row


def _replay(session: Session, team_id: str, key: str, digest: str) -> FineTuningJob | None:
    prior = session.scalar(
        select(FineTuningJob).where(FineTuningJob.team_id == team_id, FineTuningJob.idempotency_key == key)
    )
    if prior is not None and prior.request_hash != digest:
        raise APIError(
            409,
            "This Idempotency-Key was already used with a different request body",
            param="Idempotency-Key", code="idempotency_key_reused",
        )
    return prior


@router.post("", response_model=JobOut, responses=error_responses(400, 409, 413))
async def create_job(
    body: JobCreate,
    request: Request,
    team: TeamDep,
    settings: SettingsDep,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", max_length=255)] = None,
) -> JSONResponse | JobOut:
    """Create a fine-tuning job and put it on its queue.

    With an ``Idempotency-Key`` header, a retry with the same body returns the job created the first
    time; the same key with a different body is refused with 409.
    """
    return await run_db(request, _create_job, request, body, team, settings, idempotency_key)


def _create_job(
    session: Session,
    request: Request,
    body: JobCreate,
    team: Principal,
    settings: Settings,
    idempotency_key: str | None,
) -> JSONResponse | JobOut:
    digest = _request_hash(body)
    if idempotency_key:
        prior = _replay(session, team.team_id, idempotency_key, digest)
        if prior is not None:
            return JSONResponse(_job_out(session, prior).model_dump(mode="json"),
                                headers={"Idempotent-Replayed": "true"})

    hyperparameters, hp_param = _hyperparameters(body)
    model = integration.resolve_model(body.model)
    training = _check_file(session, team.team_id, body.training_file, "training_file")
    validation = (
        _check_file(session, team.team_id, body.validation_file, "validation_file")
        if body.validation_file else None
    )
    engine = _engine(body)
    seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
    job_id = new_id("ftjob")
    integration.check_job_spec(
        model=model,
        training_file=Path(training.storage_path),
        validation_file=Path(validation.storage_path) if validation else None,
        hyperparameters=hyperparameters,
        hyperparameters_param=hp_param,
        engine=engine,
        seed=seed,
        output_dir=settings.resolved_jobs_dir / job_id,
    )

    job = FineTuningJob(
        id=job_id,
        team_id=team.team_id,
        model=model,
        training_file_id=body.training_file,
        validation_file_id=body.validation_file,
        status=JobStatus.queued.value,
        hyperparameters=hyperparameters,
        engine=engine,
        suffix=body.suffix or None,
        seed=seed,
        user_metadata=body.metadata,
        idempotency_key=idempotency_key,
        request_hash=digest,
        queue=settings.default_queue,
    )
    session.add(job)
    session.flush()
    add_event(session, job.id, f"Created fine-tuning job: {job.id}", data={"status": job.status})
    add_event(session, job.id, f"Job queued on {job.queue}", data={"status": job.status, "queue": job.queue})
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        if idempotency_key:
            prior = _replay(session, team.team_id, idempotency_key, digest)
            if prior is not None:  # a concurrent request with the same key won the race
                return JSONResponse(_job_out(session, prior).model_dump(mode="json"),
                                    headers={"Idempotent-Replayed": "true"})
        raise

    try:
        request.app.state.enqueue(job.id, job.queue)
    except Exception as exc:
        log.exception("could not enqueue %s", job.id)
        session.delete(job)
        session.commit()
        raise APIError(503, "The job queue is unavailable; retry shortly", code="broker_unavailable",
                       headers={"Retry-After": "2"}) from exc
    # The outbox's second step: without this stamp (we die first, the commit fails), the reaper
    # dispatches the job again after dispatch_grace_seconds, a harmless duplicate.
    try:
        mark_dispatched(session, job.id)
        session.commit()
    except Exception:
        log.warning("job %s: enqueued, but could not record it", job.id, exc_info=True)
        session.rollback()
    return _job_out(session, job)


# --- read, cancel ------------------------------------------------------------------------------------


@router.get("", response_model=ListObject[JobOut], responses=error_responses(400, 404))
async def list_jobs(
    request: Request,
    team: TeamDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = DEFAULT_LIMIT,
    status: JobStatus | None = None,
) -> dict[str, Any]:
    """Newest first; ``after`` is the id of the last job of the previous page."""
    return await run_db(request, _list_jobs, team.team_id, after, limit, status)


# The read statements are built once (bound parameters): building a select of two dozen columns and
# its cache key costs more per request than running it.
_JOB_CURSOR = select(FineTuningJob.team_id, FineTuningJob.created_at).where(
    FineTuningJob.id == bindparam("job_id")
)
_GET_JOB = select(*JOB_COLUMNS, QUEUE_POSITION).where(
    FineTuningJob.id == bindparam("job_id"), FineTuningJob.team_id == bindparam("team_id")
)


@functools.cache
def _list_statement(with_status: bool, with_cursor: bool) -> Select[Any]:
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
            after_clause((FineTuningJob.created_at, FineTuningJob.id),
                         (bindparam("after_created_at"), bindparam("after_id")), descending=True)
        )
    return stmt.order_by(FineTuningJob.created_at.desc(), FineTuningJob.id.desc()).limit(bindparam("limit"))


def _list_jobs(
    session: Session, team_id: str, after: str | None, limit: int, status: JobStatus | None
) -> dict[str, Any]:
    params: dict[str, Any] = {"team_id": team_id, "limit": limit + 1}
    if status is not None:
        params["status"] = status.value
    if after:
        cur = session.execute(_JOB_CURSOR, {"job_id": after}).first()
        if cur is None or cur.team_id != team_id:
            raise not_found("fine-tuning job", after, param="after")
        params["after_created_at"], params["after_id"] = cur.created_at, after
    rows = session.execute(_list_statement(status is not None, bool(after)), params).all()
    has_more = len(rows) > limit
    data = [job_dict(r, r.pos) for r in rows[:limit]]
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


@router.get("/{fine_tuning_job_id}", response_model=JobOut, responses=error_responses(404))
async def retrieve_job(fine_tuning_job_id: str, request: Request, team: TeamDep) -> dict[str, Any]:
    return await run_db(request, _retrieve_job, team.team_id, fine_tuning_job_id)


def _retrieve_job(session: Session, team_id: str, job_id: str) -> dict[str, Any]:
    row = session.execute(_GET_JOB, {"job_id": job_id, "team_id": team_id}).first()
    if row is None:
        raise not_found("fine-tuning job", job_id, param="fine_tuning_job_id")
    return job_dict(row, row.queue_position)


@router.post("/{fine_tuning_job_id}/cancel", response_model=JobOut, responses=error_responses(404, 409))
async def cancel_job(fine_tuning_job_id: str, request: Request, team: TeamDep) -> JobOut:
    """A job not yet started is cancelled at once; a running one stops at its next step (the worker
    checkpoints, exits and sets ``cancelled``); a finished one cannot be cancelled (409)."""
    return await run_db(request, _cancel_job, team.team_id, fine_tuning_job_id)


def _cancel_job(session: Session, team_id: str, job_id: str) -> JobOut:
    job = get_team_job(session, team_id, job_id, lock=True)
    status = JobStatus(job.status)
    if status.terminal:
        raise APIError(409, f"Job {job.id} has already {status.value}; it cannot be cancelled",
                       param="fine_tuning_job_id", code="job_not_cancellable")
    if not job.cancel_requested:
        job.cancel_requested = True
        if job.status in PENDING:
            set_status(session, job, JobStatus.cancelled, message="Job cancelled before it started")
        else:
            add_event(session, job.id, "Cancellation requested; the job stops after the current step",
                      data={"status": job.status, "cancel_requested": True})
    session.commit()
    return _job_out(session, job)


# --- events ------------------------------------------------------------------------------------------


def _event_seq(session: Session, job_id: str, event_id: str, param: str) -> int:
    seq = session.scalar(select(JobEvent.seq).where(JobEvent.id == event_id, JobEvent.job_id == job_id))
    if seq is None:
        raise APIError(400, f"No such event for this job: {event_id}", param=param, code="invalid_cursor")
    return seq


def _wants_stream(request: Request, stream: bool) -> bool:
    return stream or "text/event-stream" in request.headers.get("accept", "")


@router.get(
    "/{fine_tuning_job_id}/events",
    response_model=ListObject[EventOut],
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "list, or SSE with stream=true"},
        **error_responses(400, 404),
    },
)
async def list_events(
    fine_tuning_job_id: str,
    request: Request,
    team: TeamDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = DEFAULT_LIMIT,
    stream: bool = False,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> Any:
    """Newest first, like OpenAI. With ``stream=true`` (or ``Accept: text/event-stream``): a
    server-sent event stream, oldest first, from after ``after``/``Last-Event-ID``, that follows new
    events until the job has finished, then sends ``data: [DONE]``."""
    if _wants_stream(request, stream):
        cursor = last_event_id or after
        job_id, start = await run_db(request, _stream_start, team.team_id, fine_tuning_job_id, cursor)
        return StreamingResponse(
            _sse(request, job_id, start),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await run_db(request, _list_events, team.team_id, fine_tuning_job_id, after, limit)


def _stream_start(session: Session, team_id: str, job_id: str, cursor: str | None) -> tuple[str, int]:
    job = get_team_job(session, team_id, job_id)
    return job.id, (_event_seq(session, job.id, cursor, "after") if cursor else 0)


def _list_events(
    session: Session, team_id: str, job_id: str, after: str | None, limit: int
) -> ListObject[EventOut]:
    job = get_team_job(session, team_id, job_id)
    stmt = select(JobEvent).where(JobEvent.job_id == job.id)
    cursor_seq = (_event_seq(session, job.id, after, "after"),) if after else None
    rows, has_more = page(session, stmt, (JobEvent.seq,), after=cursor_seq, limit=limit, descending=True)
    data = [event_object(r) for r in rows]
    return ListObject[EventOut](data=data, has_more=has_more, first_id=data[0].id if data else None,
                                last_id=data[-1].id if data else None)


async def _sse(request: Request, job_id: str, after_seq: int) -> AsyncIterator[str]:
    api_settings = request.app.state.api_settings
    maker = request.app.state.sessionmaker
    poll = api_settings.stream_poll_seconds
    keepalive = api_settings.stream_keepalive_seconds

    def fetch(last: int) -> tuple[str | None, list[EventOut], list[int]]:
        with maker() as s:
            status = s.scalar(select(FineTuningJob.status).where(FineTuningJob.id == job_id))
            rows = list(
                s.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.seq > last)
                          .order_by(JobEvent.seq).limit(500))
            )
            return status, [event_object(r) for r in rows], [r.seq for r in rows]

    last = after_seq
    idle = 0.0
    final_round = False
    while True:
        if await request.is_disconnected():
            return
        try:
            status, events, seqs = await run_in_threadpool(fetch, last)
        except Exception:  # the database went away: tell the client, it can resume with Last-Event-ID
            log.warning("event stream for %s: database error", job_id, exc_info=True)
            yield "event: error\ndata: " + json.dumps({"error": {"message": "database unavailable",
                                                                 "type": "server_error",
                                                                 "code": "database_unavailable"}}) + "\n\n"
            return
        for ev, seq in zip(events, seqs, strict=True):
            yield f"id: {ev.id}\ndata: {ev.model_dump_json()}\n\n"
            last = seq
        if events:
            idle = 0.0
            continue
        if status is None or JobStatus(status).terminal:
            # Writers may add a last event just after the terminal status: look once more.
            if final_round:
                yield "data: [DONE]\n\n"
                return
            final_round = True
        await asyncio.sleep(poll)
        idle += poll
        if idle >= keepalive:
            idle = 0.0
            yield ": keep-alive\n\n"


# --- checkpoints, metrics ----------------------------------------------------------------------------


@router.get("/{fine_tuning_job_id}/checkpoints", response_model=ListObject[JobCheckpoint],
            responses=error_responses(400, 404))
async def list_checkpoints(
    fine_tuning_job_id: str,
    request: Request,
    team: TeamDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 10,
) -> ListObject[JobCheckpoint]:
    """Newest first (highest step first)."""
    return await run_db(request, _list_checkpoints, team.team_id, fine_tuning_job_id, after, limit)


def _list_checkpoints(
    session: Session, team_id: str, job_id: str, after: str | None, limit: int
) -> ListObject[JobCheckpoint]:
    job = get_team_job(session, team_id, job_id)
    stmt = select(CheckpointRow).where(CheckpointRow.job_id == job.id)
    cursor = None
    if after:
        cur = session.get(CheckpointRow, after)
        if cur is None or cur.job_id != job.id:
            raise APIError(400, f"No such checkpoint for this job: {after}", param="after", code="invalid_cursor")
        cursor = (cur.step_number,)
    rows, has_more = page(session, stmt, (CheckpointRow.step_number,), after=cursor, limit=limit,
                          descending=True)
    data = [checkpoint_object(r) for r in rows]
    return ListObject[JobCheckpoint](data=data, has_more=has_more, first_id=data[0].id if data else None,
                                     last_id=data[-1].id if data else None)


@router.get("/{fine_tuning_job_id}/metrics", response_model=ListObject[StepMetric],
            responses=error_responses(400, 404))
async def list_metrics(
    fine_tuning_job_id: str,
    request: Request,
    team: TeamDep,
    after: Annotated[int | None, Query(ge=0, le=2**31 - 1, description="the last step of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 1000,
) -> ListObject[StepMetric]:
    """Per-step figures of a job, oldest first: loss, step and stall seconds, stall fraction,
    GPU utilization, CPU optimizer time and transfer bytes (our extra)."""
    return await run_db(request, _list_metrics, team.team_id, fine_tuning_job_id, after, limit)


def _list_metrics(
    session: Session, team_id: str, job_id: str, after: int | None, limit: int
) -> ListObject[StepMetric]:
    job = get_team_job(session, team_id, job_id)
    stmt = select(JobStepMetric).where(JobStepMetric.job_id == job.id)
    rows, has_more = page(session, stmt, (JobStepMetric.step,), after=(after,) if after is not None else None,
                          limit=limit, descending=False)
    data = [
        StepMetric(
            step=r.step, created_at=unix(r.created_at) or 0, train_loss=r.train_loss, valid_loss=r.valid_loss,
            lr=r.lr, tokens_per_second=r.tokens_per_second, step_seconds=r.step_seconds or 0.0,
            stall_seconds=r.stall_seconds or 0.0, stall_fraction=r.stall_fraction or 0.0,
            gpu_utilization=r.gpu_utilization, cpu_optimizer_seconds=r.cpu_optimizer_seconds or 0.0,
            bytes_device_to_host=r.bytes_device_to_host or 0, bytes_host_to_device=r.bytes_host_to_device or 0,
        )
        for r in rows
    ]
    return ListObject[StepMetric](data=data, has_more=has_more,
                                  first_id=str(data[0].step) if data else None,
                                  last_id=str(data[-1].step) if data else None)


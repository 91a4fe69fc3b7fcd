"""``/v1/fine_tuning/jobs``: create (idempotent), list, retrieve, cancel, pause and resume (their state
rules: store.jobs ``request_pause``, ``resume``), checkpoints, and our per-step ``metrics`` extra. The
events list and stream: :mod:`api.routers.events`; how rows become API objects: :mod:`api.jobs.views`."""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.core.auth import Principal
from api.core.deps import SettingsDep, TeamDep, run_db
from api.core.errors import APIError, error_responses, not_found
from api.core.guards import AfterCursor
from api.core.pagination import DEFAULT_LIMIT, MAX_LIMIT, list_object, page
from api.jobs import admission, checks, data_check
from api.jobs.admission import admit_quotas
from api.jobs.grader_check import check_job_grader
from api.jobs.method import requested_method
from api.jobs.public_paths import PublicPaths
from api.jobs.views import (
    GET_JOB,
    JOB_CURSOR,
    checkpoint_object,
    get_team_job,
    job_dict,
    job_out,
    list_statement,
    queued_message,
    step_metric_object,
)
from api.model_names import ModelRef, spec_model_name, team_model
from api.schemas import (
    FineTuningJobObject,
    JobCheckpointObject,
    JobCreate,
    ListObject,
    StepMetric,
)
from store import quotas
from store.ids import new_id
from store.jobs import PAUSABLE, add_event, held_back, mark_dispatched, request_cancel, request_pause, resume
from store.orm import File, FineTuningJob, JobCheckpoint, JobStatus, JobStepMetric
from store.settings import Settings
from trainer.resolve import Counts
from trainer.spec import JobSpec
from worker.capacity.fit import Admitted
from worker.grading import sandbox_limits

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"], responses=error_responses(401, 503))


# --- create ------------------------------------------------------------------------------------------


def _request_hash(body: JobCreate) -> str:
    # the settings given, not the defaults filled in (as the request said them)
    canon = body.model_dump(mode="json", exclude_none=True, exclude_unset=True)
    text = json.dumps(canon, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _check_file(session: Session, team_id: str, file_id: str, param: str) -> File:
    row = session.get(File, file_id)
    if row is None or row.team_id != team_id:
        raise APIError(400, f"Invalid {param}: no such file {file_id!r}", param=param, code="file_not_found")
    if row.purpose != "fine-tune":
        raise APIError(
            400,
            f"Invalid {param}: file {file_id} has purpose {row.purpose!r}, not 'fine-tune'",
            param=param,
            code="invalid_file_purpose",
        )
    if row.status != "processed":
        raise APIError(
            400,
            f"Invalid {param}: file {file_id} is not ready ({row.status})",
            param=param,
            code="file_not_ready",
        )
    return row


def _replay(session: Session, team_id: str, key: str, digest: str) -> FineTuningJob | None:
    prior = session.scalar(
        select(FineTuningJob).where(FineTuningJob.team_id == team_id, FineTuningJob.idempotency_key == key)
    )
    if prior is not None and prior.request_hash != digest:
        raise APIError(
            409,
            "This Idempotency-Key was already used with a different request body",
            param="Idempotency-Key",
            code="idempotency_key_reused",
        )
    return prior


#: Inserts tried by one create whose Idempotency-Key raced another request's (see _insert_or_replay).
_INSERT_ATTEMPTS = 3


def plan_event_row(admitted: Admitted) -> tuple[str, dict[str, Any]]:
    """The create's plan event: the plan the job's settings were decided by, for which worker."""
    plan = admitted.plan
    text = f"{plan.summary()} ({admitted.worker})" + "".join(f". {r}" for r in plan.reasons)
    return text, {"plan": plan.as_dict()}


def _insert_or_replay(
    session: Session,
    job: FineTuningJob,
    idempotency_key: str | None,
    digest: str,
    queued: str,
    plan: tuple[str, dict[str, Any]] | None = None,
) -> FineTuningJob | None:
    """Insert and commit ``job`` with its first events; or, when a concurrent request with the same
    ``Idempotency-Key`` got there first, the job that request made (the caller replays it).

    The unique constraint on (team_id, idempotency_key) fires at the flush: on PostgreSQL the loser's
    INSERT waits for the winner's transaction and fails once it commits, so after the rollback the
    winner's row is visible. Should the winner's row be gone again (its enqueue failed and it removed
    it), the insert is tried again, a bounded number of times.
    """
    for attempt in range(1, _INSERT_ATTEMPTS + 1):
        session.add(job)
        try:
            session.flush()
            add_event(session, job.id, f"Created fine-tuning job: {job.id}", data={"status": job.status})
            if plan is not None:
                add_event(session, job.id, plan[0], data=plan[1])
            add_event(session, job.id, queued, data={"status": job.status, "queue": job.queue})
            session.commit()
            return None
        except IntegrityError:
            session.rollback()
            if not idempotency_key:
                raise
            prior = _replay(session, job.team_id, idempotency_key, digest)
            if prior is not None:
                return prior
            if attempt == _INSERT_ATTEMPTS:
                raise
            log.info("job create with Idempotency-Key: the racing job is gone, inserting again (%d)", attempt)
    raise AssertionError("unreachable")


@router.post("", response_model=FineTuningJobObject, responses=error_responses(400, 404, 409, 413, 429))
async def create_job(
    body: JobCreate,
    request: Request,
    team: TeamDep,
    settings: SettingsDep,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", max_length=255)] = None,
) -> JSONResponse | FineTuningJobObject:
    """Create a fine-tuning job and put it on its queue.

    With an ``Idempotency-Key`` header, a retry with the same body returns the job created the first
    time; the same key with a different body is refused with 409. A value over the server's bounds is
    a 400 naming the field; a create over one of the team's quotas a 429 (or 400) ``quota_exceeded``.
    """
    prepared = await run_db(request, _prepare_job, request, body, team, settings, idempotency_key)
    if isinstance(prepared, JSONResponse):  # an Idempotency-Key's replay
        return prepared
    # Every example rendered with the model's template, in a check process (api.jobs.check_pool), not in a
    # database thread; an outcome kept on the file's row is reused: 400 naming lines; the client gone: no job
    model_name = Path(prepared.spec.model).name
    counts = await data_check.check_job_data(
        request, team.team_id, model_name, prepared.data_checks, item_fields=prepared.item_fields
    )
    prepared.counts = counts or prepared.counts
    return await run_db(request, _create_job, request, body, team, settings, idempotency_key, prepared)


@dataclass
class _Prepared:
    """What a create's checks before the data hand to its insert after it."""

    digest: str
    hp_param: str
    model: ModelRef
    seed: int
    job_id: str
    spec: JobSpec
    queue: str
    data_checks: list[data_check.FileCheck]
    #: The training data's counts: the file's example count until the data check counts them.
    counts: Counts
    #: A reinforcement job's grader's item fields, by the param reading each (the rows must have them).
    item_fields: dict[str, str]


def _prepare_job(
    session: Session,
    request: Request,
    body: JobCreate,
    team: Principal,
    settings: Settings,
    idempotency_key: str | None,
) -> JSONResponse | _Prepared:
    digest = _request_hash(body)
    if idempotency_key:
        prior = _replay(session, team.team_id, idempotency_key, digest)
        if prior is not None:
            return JSONResponse(
                job_out(session, prior, PublicPaths.of(settings)).model_dump(mode="json"),
                headers={"Idempotent-Replayed": "true"},
            )

    method, hyperparameters, hp_param = requested_method(body)
    graded = check_job_grader(  # 400 naming the grader's param, 404 its model not the team's
        session,
        team.team_id,
        method,
        settings,
        serving_url=request.app.state.api_settings.inference_server_url,
        limits=sandbox_limits(settings),
    )
    if graded.judges is not None:
        method = {**method, "judges": graded.judges.model_dump(mode="json")}
    model = team_model(session, team.team_id, body.model, settings)  # 400 a path, 404 not the team's
    checks.check_model_folder(model.path, body.model)  # config, weights, tokenizer: 400 naming the cause
    training = _check_file(session, team.team_id, body.training_file, "training_file")
    validation = (
        _check_file(session, team.team_id, body.validation_file, "validation_file")
        if body.validation_file
        else None
    )
    checks.check_integrations(body.integrations, settings)  # 400: a type the server does not allow
    seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
    job_id = new_id("ftjob")
    spec = checks.check_job_spec(
        model=spec_model_name(model),
        training_file=Path(training.storage_path),
        validation_file=Path(validation.storage_path) if validation else None,
        method=method,
        hyperparameters=hyperparameters,
        hyperparameters_param=hp_param,
        engine=body.engine,
        resources=body.resources,
        seed=seed,
        output_dir=settings.resolved_jobs_dir / job_id,
        limits=checks.job_limits(settings),
        num_examples=training.num_examples or None,
    )
    admission.check_gpus(session, spec.resources.gpus, settings)  # 400: no live worker runs jobs this large
    queue = checks.job_queue(spec.resources.gpus, settings)
    admission.check_nodes(session, spec.resources.nodes, spec.resources.gpus, queue, settings)  # 400: no gang
    planned = data_check.plan_job_checks(spec, training, validation, settings)
    counts = Counts(training.num_examples or 1)
    return _Prepared(digest, hp_param, model, seed, job_id, spec, queue, planned, counts, graded.item_fields)


def _create_job(
    session: Session,
    request: Request,
    body: JobCreate,
    team: Principal,
    settings: Settings,
    idempotency_key: str | None,
    prepared: _Prepared,
) -> JSONResponse | FineTuningJobObject:
    digest, spec, queue, hp_param = prepared.digest, prepared.spec, prepared.queue, prepared.hp_param
    # The files again, as the data check may have taken a while: still the team's and ready.
    _check_file(session, team.team_id, body.training_file, "training_file")
    if body.validation_file:
        _check_file(session, team.team_id, body.validation_file, "validation_file")
    admitted = admission.admit_job(  # resolved for the first worker it fits; 400: it fits none
        session, spec, settings, queue=queue, counts=prepared.counts, hyperparameters_param=hp_param
    )
    # Quotas, counted under the team's row lock (held to the commit): racing creates go one by one.
    quotas.lock_team(session, team.team_id)
    if idempotency_key and (prior := _replay(session, team.team_id, idempotency_key, digest)) is not None:
        # a request with this key committed while we waited for the lock: replay it, whatever the quota
        return JSONResponse(
            job_out(session, prior, PublicPaths.of(settings)).model_dump(mode="json"),
            headers={"Idempotent-Replayed": "true"},
        )
    admission.admit_quotas(session, team.team_id, settings)

    job = FineTuningJob(
        id=prepared.job_id,
        team_id=team.team_id,
        model=prepared.model.id,
        training_file_id=body.training_file,
        validation_file_id=body.validation_file,
        status=JobStatus.queued.value,
        request=checks.job_request(
            spec,
            model=prepared.model.id,
            training_file=body.training_file,
            validation_file=body.validation_file,
        ),
        resolutions=[admitted.resolution],
        integrations=checks.check_integrations(body.integrations, settings),
        suffix=body.suffix or None,
        seed=prepared.seed,
        user_metadata=body.metadata,
        idempotency_key=idempotency_key,
        request_hash=digest,
        queue=queue,
    )
    queued = queued_message(queue, [c for _, c in admission.candidates(session, queue, settings)])
    plan = plan_event_row(admitted)
    prior = _insert_or_replay(session, job, idempotency_key, digest, queued, plan)
    if prior is not None:  # a concurrent request with the same key won the race
        return JSONResponse(
            job_out(session, prior, PublicPaths.of(settings)).model_dump(mode="json"),
            headers={"Idempotent-Replayed": "true"},
        )

    try:
        request.app.state.enqueue(job.id, job.queue)
    except Exception as exc:
        log.exception("could not enqueue %s", job.id)
        session.delete(job)
        session.commit()
        raise APIError(
            503,
            "The job queue is unavailable; retry shortly",
            code="broker_unavailable",
            headers={"Retry-After": "2"},
        ) from exc
    # The outbox's second step: without this stamp (we die first, the commit fails), the reaper
    # dispatches the job again after dispatch_grace_seconds, a harmless duplicate.
    try:
        mark_dispatched(session, job.id)
        session.commit()
    except Exception:
        log.warning("job %s: enqueued, but could not record it", job.id, exc_info=True)
        session.rollback()
    return job_out(session, job)


# --- read, cancel ------------------------------------------------------------------------------------


@router.get("", response_model=ListObject[FineTuningJobObject], responses=error_responses(400, 404))
async def list_jobs(
    request: Request,
    team: TeamDep,
    after: AfterCursor = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = DEFAULT_LIMIT,
    status: JobStatus | None = None,
) -> dict[str, Any]:
    """Newest first; ``after`` is the id of the last job of the previous page."""
    paths = PublicPaths.of(request.app.state.settings)
    return await run_db(request, _list_jobs, team.team_id, after, limit, status, paths)


def _list_jobs(
    session: Session,
    team_id: str,
    after: str | None,
    limit: int,
    status: JobStatus | None,
    paths: PublicPaths,
) -> dict[str, Any]:
    params: dict[str, Any] = {"team_id": team_id, "limit": limit + 1}
    if status is not None:
        params["status"] = status.value
    if after:
        cur = session.execute(JOB_CURSOR, {"job_id": after}).first()
        if cur is None or cur.team_id != team_id:
            raise not_found("fine-tuning job", after, param="after")
        params["after_created_at"], params["after_id"] = cur.created_at, after
    rows = session.execute(list_statement(status is not None, bool(after)), params).all()
    has_more = len(rows) > limit
    # Plain dicts, validated once as the whole response by its model (no per-job model instance).
    return list_object([job_dict(r, r.pos, paths) for r in rows[:limit]], has_more, id_of=itemgetter("id"))


@router.get("/{fine_tuning_job_id}", response_model=FineTuningJobObject, responses=error_responses(404))
async def retrieve_job(fine_tuning_job_id: str, request: Request, team: TeamDep) -> dict[str, Any]:
    paths = PublicPaths.of(request.app.state.settings)
    return await run_db(request, _retrieve_job, team.team_id, fine_tuning_job_id, paths)


def _retrieve_job(session: Session, team_id: str, job_id: str, paths: PublicPaths) -> dict[str, Any]:
    row = session.execute(GET_JOB, {"job_id": job_id, "team_id": team_id}).first()
    if row is None:
        raise not_found("fine-tuning job", job_id, param="fine_tuning_job_id")
    return job_dict(row, row.queue_position, paths)


@router.post(
    "/{fine_tuning_job_id}/cancel", response_model=FineTuningJobObject, responses=error_responses(404, 409)
)
async def cancel_job(fine_tuning_job_id: str, request: Request, team: TeamDep) -> FineTuningJobObject:
    """A job not yet started is cancelled at once; a running one stops at its next step (the worker
    checkpoints, exits and sets ``cancelled``); a finished one cannot be cancelled (409)."""
    return await run_db(request, _cancel_job, team.team_id, fine_tuning_job_id)


def _cancel_job(session: Session, team_id: str, job_id: str) -> FineTuningJobObject:
    job = get_team_job(session, team_id, job_id, lock=True)
    status = JobStatus(job.status)
    if status.terminal:
        raise APIError(
            409,
            f"Job {job.id} has already {status.value}; it cannot be cancelled",
            param="fine_tuning_job_id",
            code="job_not_cancellable",
        )
    request_cancel(session, job)
    session.commit()
    return job_out(session, job)


# --- pause, resume ------------------------------------------------------------------------------


@router.post(
    "/{fine_tuning_job_id}/pause", response_model=FineTuningJobObject, responses=error_responses(404, 409)
)
async def pause_job(fine_tuning_job_id: str, request: Request, team: TeamDep) -> FineTuningJobObject:
    """A job waiting in its queue is paused at once; a running one stops at its next step (the worker
    checkpoints, frees its GPUs and sets ``paused``; meanwhile ``pause_requested`` is true). A paused
    job is returned as it is; a finished one, or one being cancelled, cannot be paused (409)."""
    return await run_db(request, _pause_job, team.team_id, fine_tuning_job_id)


def _pause_job(session: Session, team_id: str, job_id: str) -> FineTuningJobObject:
    job = get_team_job(session, team_id, job_id, lock=True)
    if job.status not in (*PAUSABLE, JobStatus.paused.value):
        raise APIError(
            409,
            f"Job {job.id} has already {job.status}; it cannot be paused",
            param="fine_tuning_job_id",
            code="job_not_pausable",
        )
    if job.cancel_requested:
        raise APIError(
            409,
            f"Job {job.id} is being cancelled; it cannot be paused",
            param="fine_tuning_job_id",
            code="job_not_pausable",
        )
    request_pause(session, job)
    session.commit()
    return job_out(session, job)


@router.post(
    "/{fine_tuning_job_id}/resume",
    response_model=FineTuningJobObject,
    responses=error_responses(400, 404, 409, 429),
)
async def resume_job(
    fine_tuning_job_id: str, request: Request, team: TeamDep, settings: SettingsDep
) -> FineTuningJobObject:
    """A paused job goes back to its queue (``queued``) and resumes from the checkpoint it paused at, in
    its fair-share place. A job that is not paused cannot be resumed (409); a team over its quotas gets
    the errors a create would (429 or 400 ``quota_exceeded``)."""
    return await run_db(request, _resume_job, request, team.team_id, fine_tuning_job_id, settings)


def _resume_job(
    session: Session, request: Request, team_id: str, job_id: str, settings: Settings
) -> FineTuningJobObject:
    job = get_team_job(session, team_id, job_id, lock=True)
    if job.status != JobStatus.paused.value:
        pending = " (its pause is pending)" if job.pause_requested else ""
        raise APIError(
            409,
            f"Job {job.id} is {job.status}{pending}; only a paused job can be resumed",
            param="fine_tuning_job_id",
            code="job_not_paused",
        )
    # As a create: the team's quotas counted under its row lock (held to the commit).
    quotas.lock_team(session, team_id)
    admit_quotas(session, team_id, settings)
    queue = resume(session, job)
    session.commit()
    if held_back(job):  # a full disk's wait off the GPU not over yet: worker.dispatch sends it after it
        return job_out(session, job)
    # The outbox, as a create: the message after the commit, then its stamp; when either fails the
    # reaper's dispatcher sends the job (it is queued without dispatched_at).
    try:
        request.app.state.enqueue(job.id, queue)
        mark_dispatched(session, job.id)
        session.commit()
    except Exception:
        log.warning("job %s: resumed, but its message is left to the dispatcher", job.id, exc_info=True)
        session.rollback()
    return job_out(session, job)


# --- checkpoints, metrics ----------------------------------------------------------------------------


@router.get(
    "/{fine_tuning_job_id}/checkpoints",
    response_model=ListObject[JobCheckpointObject],
    responses=error_responses(400, 404),
)
async def list_checkpoints(
    fine_tuning_job_id: str,
    request: Request,
    team: TeamDep,
    after: AfterCursor = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 10,
) -> dict[str, Any]:
    """Newest first (highest step first)."""
    return await run_db(request, _list_checkpoints, team.team_id, fine_tuning_job_id, after, limit)


def _list_checkpoints(
    session: Session, team_id: str, job_id: str, after: str | None, limit: int
) -> dict[str, Any]:
    job = get_team_job(session, team_id, job_id)
    stmt = select(JobCheckpoint).where(JobCheckpoint.job_id == job.id)
    cursor = None
    if after:
        cur = session.get(JobCheckpoint, after)
        if cur is None or cur.job_id != job.id:
            raise APIError(
                400, f"No such checkpoint for this job: {after}", param="after", code="invalid_cursor"
            )
        cursor = (cur.step_number,)
    rows, has_more = page(
        session, stmt, (JobCheckpoint.step_number,), after=cursor, limit=limit, descending=True
    )
    return list_object([checkpoint_object(r) for r in rows], has_more)


@router.get(
    "/{fine_tuning_job_id}/metrics",
    response_model=ListObject[StepMetric],
    responses=error_responses(400, 404),
)
async def list_metrics(
    fine_tuning_job_id: str,
    request: Request,
    team: TeamDep,
    after: Annotated[
        int | None, Query(ge=0, le=2**31 - 1, description="the last step of the previous page")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 1000,
) -> dict[str, Any]:
    """Per-step figures of a job, oldest first: loss, step and stall seconds, stall fraction,
    GPU utilization, CPU optimizer time and transfer bytes (our extra)."""
    return await run_db(request, _list_metrics, team.team_id, fine_tuning_job_id, after, limit)


def _list_metrics(
    session: Session, team_id: str, job_id: str, after: int | None, limit: int
) -> dict[str, Any]:
    job = get_team_job(session, team_id, job_id)
    stmt = select(JobStepMetric).where(JobStepMetric.job_id == job.id)
    rows, has_more = page(
        session,
        stmt,
        (JobStepMetric.step,),
        after=(after,) if after is not None else None,
        limit=limit,
        descending=False,
    )
    return list_object([step_metric_object(r) for r in rows], has_more, id_of=lambda m: str(m.step))

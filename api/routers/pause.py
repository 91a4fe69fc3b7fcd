"""``POST /v1/fine_tuning/jobs/{id}/pause`` and ``/resume`` (OpenAI's ``client.fine_tuning.jobs.pause``
and ``.resume``). The semantics live in :mod:`store.pause`: a waiting job is paused at once, a running
one stops at its next step (checkpointing there) and its runner writes ``paused``; a resume puts the job
back in its queue, admitted by its team's quotas as a create is, to resume from its checkpoint."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from sqlalchemy.orm import Session

from api.core.deps import SettingsDep, TeamDep, run_db
from api.core.errors import APIError, error_responses
from api.jobs.admission import admit_quotas
from api.jobs.views import get_team_job, job_out
from api.schemas import FineTuningJobObject
from store import quotas
from store.jobs import held_back, mark_dispatched
from store.orm import JobStatus
from store.pause import PAUSABLE, request_pause, resume
from store.settings import Settings

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"], responses=error_responses(401, 503))


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

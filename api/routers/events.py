"""``/v1/fine_tuning/jobs/{fine_tuning_job_id}/events``: a job's events, as a JSON list or a
server-sent event stream (SSE)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.core.deps import TeamDep, run_db
from api.core.errors import APIError, error_responses
from api.core.guards import AfterCursor
from api.core.pagination import DEFAULT_LIMIT, MAX_LIMIT, list_object, page
from api.jobs.public_paths import PublicPaths
from api.jobs.views import event_object, get_team_job
from api.schemas import JobEventObject, ListObject
from store.orm import FineTuningJob, JobEvent, JobStatus

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"], responses=error_responses(401, 503))


def _event_seq(session: Session, job_id: str, event_id: str, param: str) -> int:
    seq = session.scalar(select(JobEvent.seq).where(JobEvent.id == event_id, JobEvent.job_id == job_id))
    if seq is None:
        raise APIError(400, f"No such event for this job: {event_id}", param=param, code="invalid_cursor")
    return seq


def _wants_stream(request: Request, stream: bool) -> bool:
    return stream or "text/event-stream" in request.headers.get("accept", "")


@router.get(
    "/{fine_tuning_job_id}/events",
    response_model=ListObject[JobEventObject],
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "list, or SSE with stream=true"},
        **error_responses(400, 404),
    },
)
async def list_events(
    fine_tuning_job_id: str,
    request: Request,
    team: TeamDep,
    after: AfterCursor = None,
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
    paths = PublicPaths.of(request.app.state.settings)
    return await run_db(request, _list_events, team.team_id, fine_tuning_job_id, after, limit, paths)


def _stream_start(session: Session, team_id: str, job_id: str, cursor: str | None) -> tuple[str, int]:
    job = get_team_job(session, team_id, job_id)
    return job.id, (_event_seq(session, job.id, cursor, "after") if cursor else 0)


def _list_events(
    session: Session, team_id: str, job_id: str, after: str | None, limit: int, paths: PublicPaths
) -> dict[str, Any]:
    job = get_team_job(session, team_id, job_id)
    stmt = select(JobEvent).where(JobEvent.job_id == job.id)
    cursor_seq = (_event_seq(session, job.id, after, "after"),) if after else None
    rows, has_more = page(session, stmt, (JobEvent.seq,), after=cursor_seq, limit=limit, descending=True)
    return list_object([event_object(r, paths) for r in rows], has_more)


async def _sse(request: Request, job_id: str, after_seq: int) -> AsyncIterator[str]:
    api_settings = request.app.state.api_settings
    maker = request.app.state.sessionmaker
    poll = api_settings.stream_poll_seconds
    keepalive = api_settings.stream_keepalive_seconds
    paths = PublicPaths.of(request.app.state.settings)

    def fetch(last: int) -> tuple[str | None, list[JobEventObject], list[int]]:
        with maker() as s:
            status = s.scalar(select(FineTuningJob.status).where(FineTuningJob.id == job_id))
            rows = list(
                s.scalars(
                    select(JobEvent)
                    .where(JobEvent.job_id == job_id, JobEvent.seq > last)
                    .order_by(JobEvent.seq)
                    .limit(500)
                )
            )
            return status, [event_object(r, paths) for r in rows], [r.seq for r in rows]

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
            yield (
                "event: error\ndata: "
                + json.dumps(
                    {
                        "error": {
                            "message": "database unavailable",
                            "type": "server_error",
                            "code": "database_unavailable",
                        }
                    }
                )
                + "\n\n"
            )
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

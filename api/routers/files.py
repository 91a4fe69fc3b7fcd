"""``/v1/files``: upload (validated, size-limited, checksummed), list, retrieve, delete, content."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from sqlalchemy import Text, cast, select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api import integration
from api.deps import SettingsDep, TeamDep, run_db
from api.errors import APIError, error_responses, not_found
from api.pagination import MAX_LIMIT, list_object, page
from api.schemas import FileDeleted, FileObject, FileStatus, ListObject, unix
from api.storage import LocalFileStore, receive_upload
from store.ids import new_id
from store.models import File, FineTuningJob, JobStatus
from store.results import RESULTS_PURPOSE
from store.usage import DELETED_FILE_STATUS

router = APIRouter(prefix="/v1", tags=["files"], responses=error_responses(401, 503))

SUPPORTED_PURPOSES = ("fine-tune",)

_UPLOAD_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": list(SUPPORTED_PURPOSES)},
                    },
                }
            }
        },
    }
}


_FILE_STATUSES: dict[str, FileStatus] = {"uploaded": "uploaded", "processed": "processed", "error": "error"}


def file_object(row: File) -> FileObject:
    return FileObject(
        id=row.id,
        bytes=row.bytes,
        created_at=unix(row.created_at) or 0,
        filename=row.filename,
        purpose=row.purpose,
        status=_FILE_STATUSES.get(row.status, "processed"),
        num_examples=row.num_examples,
        sha256=row.sha256,
    )


def get_team_file(
    session: Session, team_id: str, file_id: str, *, param: str = "file_id", lock: bool = False
) -> File:
    """The team's file, or 404 (another team's, unknown, and deleted ones alike)."""
    stmt = select(File).where(File.id == file_id)
    row = session.execute(stmt.with_for_update() if lock else stmt).scalar_one_or_none()
    if row is None or row.team_id != team_id or row.status == DELETED_FILE_STATUS:
        raise not_found("File", file_id, param=param)
    return row


@router.post("/files", response_model=FileObject, openapi_extra=_UPLOAD_DOC,
             responses=error_responses(400, 413, 415, 507))
async def create_file(request: Request, team: TeamDep, settings: SettingsDep) -> FileObject:
    """Upload a JSONL training file (multipart ``file`` + ``purpose=fine-tune``)."""
    store = LocalFileStore(settings.resolved_files_dir)
    upload = await receive_upload(request, store.incoming, settings.max_upload_bytes)
    final = None
    try:
        purpose = upload.fields.get("purpose")
        if not purpose:
            raise APIError(400, "Missing required parameter: 'purpose'", param="purpose",
                           code="missing_required_parameter")
        if purpose not in SUPPORTED_PURPOSES:
            raise APIError(400, f"Unsupported purpose {purpose!r}: this server accepts 'fine-tune' files",
                           param="purpose", code="invalid_value")
        if upload.filename is None:
            raise APIError(400, "Missing required parameter: 'file'", param="file",
                           code="missing_required_parameter")
        if upload.bytes == 0:
            raise APIError(400, "The file is empty", param="file", code="invalid_file_format")
        num_examples = await run_in_threadpool(integration.validate_dataset, upload.tmp_path)

        file_id = new_id("file")
        final = store.place(upload.tmp_path, team.team_id, file_id)
        row = File(
            id=file_id,
            team_id=team.team_id,
            filename=upload.filename,
            purpose=purpose,
            bytes=upload.bytes,
            sha256=upload.sha256,
            storage_path=str(final),
            num_examples=num_examples,
            status="processed",
        )

        def insert() -> FileObject:
            with request.app.state.sessionmaker() as session:
                session.add(row)
                session.commit()
                return file_object(row)

        return await run_in_threadpool(insert)
    except BaseException:
        if final is not None:
            store.remove(final)
        raise
    finally:
        upload.discard()


@router.get("/files", response_model=ListObject[FileObject], responses=error_responses(400, 404))
async def list_files(
    request: Request,
    team: TeamDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = MAX_LIMIT,
    order: Literal["asc", "desc"] = "desc",
    purpose: str | None = None,
) -> dict[str, Any]:
    return await run_db(request, _list_files, team.team_id, after, limit, order, purpose)


def _list_files(
    session: Session, team_id: str, after: str | None, limit: int, order: str, purpose: str | None
) -> dict[str, Any]:
    stmt = select(File).where(File.team_id == team_id, File.status != DELETED_FILE_STATUS)
    if purpose:
        stmt = stmt.where(File.purpose == purpose)
    cursor = None
    if after:
        cur = get_team_file(session, team_id, after, param="after")
        cursor = (cur.created_at, cur.id)
    rows, has_more = page(session, stmt, (File.created_at, File.id), after=cursor, limit=limit,
                          descending=order == "desc")
    return list_object([file_object(r) for r in rows], has_more)


@router.get("/files/{file_id}", response_model=FileObject, responses=error_responses(404))
async def retrieve_file(file_id: str, request: Request, team: TeamDep) -> FileObject:
    return await run_db(request, lambda s: file_object(get_team_file(s, team.team_id, file_id)))


@router.delete("/files/{file_id}", response_model=FileDeleted, responses=error_responses(404, 409))
async def delete_file(file_id: str, request: Request, team: TeamDep) -> FileDeleted:
    """Delete a file and its bytes; refused (409) while a queued or running job uses it. A result file
    also leaves its job's ``result_files``."""
    return await run_db(request, _delete_file, team.team_id, file_id)


def _delete_file(session: Session, team_id: str, file_id: str) -> FileDeleted:
    row = get_team_file(session, team_id, file_id, lock=True)
    users = session.execute(
        select(FineTuningJob.id, FineTuningJob.status)
        .where((FineTuningJob.training_file_id == file_id) | (FineTuningJob.validation_file_id == file_id))
        .order_by(FineTuningJob.created_at)
    ).all()
    active = [u for u in users if not JobStatus(u.status).terminal]
    if active:
        raise APIError(409, f"File {file_id} is used by fine-tuning job {active[0].id}, which is {active[0].status}; "
                       "cancel the job or wait until it finishes", param="file_id", code="file_in_use")
    path = row.storage_path
    if users:
        # Finished jobs keep naming it (training_file, validation_file): the row stays, as a tombstone
        # that is no longer listed, served, counted or usable; the bytes go.
        row.status = DELETED_FILE_STATUS
    else:
        session.delete(row)
    if row.purpose == RESULTS_PURPOSE:
        _drop_from_result_files(session, team_id, file_id)
    session.commit()
    LocalFileStore.remove(path)
    return FileDeleted(id=file_id)


def _drop_from_result_files(session: Session, team_id: str, file_id: str) -> None:
    """Remove a result file's id from the ``result_files`` of the team's jobs that list it (a text
    search narrows the JSON lists portably, the exact test is done here)."""
    jobs = session.scalars(
        select(FineTuningJob)
        .where(FineTuningJob.team_id == team_id,
               cast(FineTuningJob.result_files, Text).contains(file_id, autoescape=True))
        .with_for_update()
    ).all()
    for job in jobs:
        if file_id in (job.result_files or []):
            job.result_files = [f for f in job.result_files or [] if f != file_id]


@router.get("/files/{file_id}/content", response_class=FileResponse, responses=error_responses(404))
async def file_content(file_id: str, request: Request, team: TeamDep) -> FileResponse:
    return await run_db(request, _file_content, team.team_id, file_id)


def _file_content(session: Session, team_id: str, file_id: str) -> FileResponse:
    row = get_team_file(session, team_id, file_id)
    if not Path(row.storage_path).is_file():
        raise APIError(404, f"The content of {file_id} is missing from storage", param="file_id",
                       code="file_content_missing")
    return FileResponse(row.storage_path, media_type="application/octet-stream", filename=row.filename,
                        headers={"X-Content-SHA256": row.sha256})

"""``/v1/files``: upload (validated, size-limited, checksummed), list, retrieve, delete, content."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from pydantic import ValidationError
from sqlalchemy import Text, cast, select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.core.deps import SettingsDep, TeamDep, run_db
from api.core.errors import APIError, error_responses, not_found, validation_error
from api.core.guards import AfterCursor
from api.core.pagination import MAX_LIMIT, list_object, page
from api.jobs import checks, data_check
from api.jobs import file_preview as file_preview_job
from api.model_names import ModelNotFound, ModelRef, spec_model_name, team_model
from api.schemas import FileDeleted, FileObject, FileStatus, ListObject, unix
from api.storage import LocalFileStore, ReceivedUpload
from api.upload_quota import check_upload_fits, receive_within_quota
from contract.hyperparameters import HyperparametersRequest
from store.ids import new_id
from store.orm import File, FineTuningJob, JobStatus
from store.results import RESULTS_PURPOSE
from store.settings import Settings
from store.usage import DELETED_FILE_STATUS

router = APIRouter(prefix="/v1", tags=["files"], responses=error_responses(401, 503))

SUPPORTED_PURPOSES = ("fine-tune",)

#: Form fields of an upload that take a job's data options (used with ``model``).
DATA_OPTION_FIELDS = ("max_seq_length", "truncation", "system_message")

_UPLOAD_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    # the data options are the check's: each is refused (400) without `model`
                    "dependentRequired": {name: ["model"] for name in DATA_OPTION_FIELDS},
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": list(SUPPORTED_PURPOSES)},
                        "model": {
                            "type": "string",
                            "description": (
                                "Optional: check every example with this model's tokenizer and chat template "
                                "now (as a job would); the response's `validation` has the counts"
                            ),
                        },
                        "max_seq_length": {"type": "integer", "description": "With `model`: as the job's"},
                        "truncation": {
                            "type": "string",
                            "enum": ["truncate", "drop", "error"],
                            "description": "With `model`: as the job's",
                        },
                        "system_message": {
                            "type": "string",
                            "enum": ["keep", "fold"],
                            "description": "With `model`: as the job's",
                        },
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
        format=data_check.file_format(row.data_checks),  # type: ignore[arg-type]
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


@router.post(
    "/files",
    response_model=FileObject,
    openapi_extra=_UPLOAD_DOC,
    responses=error_responses(400, 404, 413, 415, 507),
)
async def create_file(request: Request, team: TeamDep, settings: SettingsDep) -> FileObject:
    """Upload a JSONL training file (multipart ``file`` + ``purpose=fine-tune``). With a ``model`` field
    every example is also rendered and tokenized for that model now (``max_seq_length``, ``truncation``,
    ``system_message`` as the job's): a refusal is a 400 naming the lines, the counts come back in
    ``validation``. A file the team's storage quota has no room for is a 400 ``quota_exceeded``, nothing
    kept (api.upload_quota)."""
    store = LocalFileStore(settings.resolved_files_dir)
    upload = await receive_within_quota(request, store.incoming, team.team_id, settings)
    final = None
    try:
        purpose = upload.fields.get("purpose")
        if not purpose:
            raise APIError(
                400,
                "Missing required parameter: 'purpose'",
                param="purpose",
                code="missing_required_parameter",
            )
        if purpose not in SUPPORTED_PURPOSES:
            raise APIError(
                400,
                f"Unsupported purpose {purpose!r}: this server accepts 'fine-tune' files",
                param="purpose",
                code="invalid_value",
            )
        if upload.filename is None:
            raise APIError(
                400, "Missing required parameter: 'file'", param="file", code="missing_required_parameter"
            )
        if upload.bytes == 0:
            raise APIError(400, "The file is empty", param="file", code="invalid_file_format")
        data_options = _data_options(upload.fields)
        report = await run_in_threadpool(
            checks.validate_dataset, upload.tmp_path, limits=data_check.example_limits(settings)
        )
        validation = kept = None
        if upload.fields.get("model"):  # in a check process (api.jobs.check_pool), kept on the row
            name = upload.fields["model"]
            ref, check = await run_in_threadpool(
                _plan_model_check, request, team.team_id, settings, name, data_options, upload
            )
            validation, kept = await data_check.check_upload(
                request, team.team_id, check, ref.id, Path(check.request.model).name
            )

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
            num_examples=report.num_examples,
            status="processed",
            data_checks={data_check.UPLOAD_KEY: data_check.upload_check(report), **(kept or {})},
        )

        def insert() -> FileObject:
            with request.app.state.sessionmaker() as session:
                check_upload_fits(session, team.team_id, settings, upload.bytes)
                session.add(row)
                session.commit()
                return file_object(row).model_copy(update={"validation": validation})

        return await run_in_threadpool(insert)
    except BaseException:
        if final is not None:
            store.remove(final)
        raise
    finally:
        upload.discard()


def _data_options(fields: dict[str, str]) -> HyperparametersRequest:
    """The data options an upload gives (form fields, as the job's hyperparameters); 400 naming one."""
    given = {k: fields[k] for k in DATA_OPTION_FIELDS if fields.get(k)}
    if given and not fields.get("model"):
        name = next(iter(given))
        raise APIError(
            400,
            f"'{name}' is only used with 'model' (the data is checked with that model's tokenizer)",
            param=name,
            code="invalid_value",
        )
    try:
        return HyperparametersRequest.model_validate(given)
    except ValidationError as exc:
        raise validation_error(exc.errors(), fields=DATA_OPTION_FIELDS) from exc


def _plan_model_check(
    request: Request,
    team_id: str,
    settings: Settings,
    name: str,
    options: HyperparametersRequest,
    upload: ReceivedUpload,
) -> tuple[ModelRef, data_check.FileCheck]:
    """The check of an upload with a model the team may name (api.jobs.data_check); 400/404 naming the
    cause."""
    with request.app.state.sessionmaker() as session:
        ref = team_model(session, team_id, name, settings)
    checks.check_model_folder(ref.path, name)
    check = data_check.plan_check(
        "file",
        None,
        upload.tmp_path,
        spec_model_name(ref),
        options,
        settings,
        sha256=upload.sha256,
        size=upload.bytes,
    )
    return ref, check


@router.get("/files", response_model=ListObject[FileObject], responses=error_responses(400, 404))
async def list_files(
    request: Request,
    team: TeamDep,
    after: AfterCursor = None,
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
    rows, has_more = page(
        session, stmt, (File.created_at, File.id), after=cursor, limit=limit, descending=order == "desc"
    )
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
        raise APIError(
            409,
            f"File {file_id} is used by fine-tuning job {active[0].id}, which is {active[0].status}; "
            "cancel the job or wait until it finishes",
            param="file_id",
            code="file_in_use",
        )
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
        .where(
            FineTuningJob.team_id == team_id,
            cast(FineTuningJob.result_files, Text).contains(file_id, autoescape=True),
        )
        .with_for_update()
    ).all()
    for job in jobs:
        if file_id in (job.result_files or []):
            job.result_files = [f for f in job.result_files or [] if f != file_id]


def _require_content(storage_path: str, file_id: str) -> None:
    """A 404 when the file's bytes are gone from storage (its row is still there)."""
    if not Path(storage_path).is_file():
        raise APIError(
            404,
            f"The content of {file_id} is missing from storage",
            param="file_id",
            code="file_content_missing",
        )


@router.get("/files/{file_id}/content", response_class=FileResponse, responses=error_responses(404))
async def file_content(file_id: str, request: Request, team: TeamDep) -> FileResponse:
    return await run_db(request, _file_content, team.team_id, file_id)


def _file_content(session: Session, team_id: str, file_id: str) -> FileResponse:
    row = get_team_file(session, team_id, file_id)
    _require_content(row.storage_path, file_id)
    return FileResponse(
        row.storage_path,
        media_type="application/octet-stream",
        filename=row.filename,
        headers={"X-Content-SHA256": row.sha256},
    )


@router.get("/files/{file_id}/preview", responses=error_responses(400, 404))
async def file_preview(
    file_id: str,
    request: Request,
    team: TeamDep,
    settings: SettingsDep,
    model: Annotated[str | None, Query(description="The model whose template and tokenizer render")] = None,
    limit: Annotated[int, Query(ge=1, le=file_preview_job.MAX_PREVIEW_EXAMPLES)] = 5,
) -> dict[str, Any]:
    """The file's first ``limit`` examples rendered with ``model``'s chat template and tokenizer, as a
    job trains on them (pieces of text marked ``learned``), and the token count of each example in its
    first lines (api.jobs.file_preview). Another team's file is a 404 before anything else is looked
    at (``model`` is required, but checked second: no existence leak); an unknown model is a 400."""

    def plan(session: Session) -> tuple[File, ModelRef, str]:
        row = get_team_file(session, team.team_id, file_id)
        if not model:
            raise APIError(
                400,
                "Invalid request: model: required parameter is missing",
                param="model",
                code="missing_required_parameter",
            )
        try:
            ref = team_model(session, team.team_id, model, settings)
        except ModelNotFound as exc:
            raise APIError(400, exc.message, param="model", code="model_not_found") from exc
        return row, ref, model

    row, ref, named = await run_db(request, plan)

    def build() -> dict[str, Any]:
        checks.check_model_folder(ref.path, named)
        _require_content(row.storage_path, file_id)
        name = spec_model_name(ref)
        options = HyperparametersRequest()
        try:
            return file_preview_job.build_preview(
                file_preview_job.PreviewRequest(
                    path=row.storage_path,
                    model=name,
                    max_seq_length=data_check.data_max_length(name, options),
                    system_message=options.system_message,
                    limits=data_check.example_limits(settings),
                    limit=limit,
                )
            )
        except (OSError, ValueError) as exc:  # the tokenizer cannot be loaded (ModelFolderError)
            raise APIError(400, f"Model {named[:200]!r}: {exc}", param="model", code="invalid_model") from exc

    body = await run_in_threadpool(build)
    return {"object": "file.preview", "model": ref.id, **body}

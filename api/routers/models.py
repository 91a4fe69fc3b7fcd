"""``/v1/models``: the models a team may use (OpenAI's list, retrieve, delete) and downloads of its own.

The list holds the built-in configs, the base models under the model roots, then the team's
fine-tuned models and checkpoints (api.model_names). Every entry says whether a job can train on it:
``usable`` (false for a base folder that fails the check job create makes: config, weights and their
shapes, tokenizer) and ``unusable_reason`` (that check's message, null when usable); broken folders
stay listed so that their owner sees why. Another team's id answers exactly as an
unknown one (404 ``model_not_found``). Deleting a base model is refused (403, as OpenAI does);
deleting one of the team's models removes its files (only under ``jobs_dir``) and its id; a
checkpoint of a job that is still running cannot be deleted (409: the job may resume from it).
Downloads: api.model_download (a deterministic tar with ``X-Checksum-SHA256``, the model's files only)
of the team's models and of the base models every team may train on (folders under the model roots;
built-in configs at a seed),
with ``HEAD`` and single ``Range`` requests (api.byte_ranges) for resumable downloads.

Ids hold ``:`` and base-model names ``/``, so the id is a ``path`` parameter; the ``/content`` route
comes first, and retrieve and delete take ids that do not end in ``/content``.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Any

import anyio.to_thread
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse
from sqlalchemy import delete
from sqlalchemy.orm import Session
from starlette.convertors import Convertor, register_url_convertor

from api import model_download as dl
from api.builtin_cache import BuiltinCache
from api.byte_ranges import ByteRange, RangeNotSatisfiable, http_date, if_range_holds, parse_range
from api.core.deps import SettingsDep, TeamDep, run_db
from api.core.errors import APIError, error_responses
from api.model_names import ModelRef, available_models, shown, team_model
from api.schemas import ErrorResponse, ListObject, ModelDeleted, ModelObject
from store.model_ids import find_model
from store.orm import FineTuningJob, JobCheckpoint, JobStatus, RegisteredModel, utcnow
from store.settings import Settings
from store.usage import OUTPUT_SIZES

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/models", tags=["models"], responses=error_responses(401, 503))


class _ModelId(Convertor[str]):
    """A model id (it may hold ``/``) that does not end in ``/content``: that path is the download's
    alone, so it is not also a retrieve or a delete (and ``Allow`` names only GET and HEAD there)."""

    regex = r".+(?<!/content)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("model_id", _ModelId())

#: The checksum of the whole tar, hex (computed before the first download, cached: api.model_download).
CHECKSUM_HEADER = "X-Checksum-SHA256"
TAR = "application/x-tar"


def model_object(ref: ModelRef) -> dict[str, Any]:
    return {
        "id": ref.id,
        "object": "model",
        "created": ref.created,
        "owned_by": ref.owned_by,
        "kind": ref.kind,
        "usable": ref.unusable_reason is None,
        "unusable_reason": ref.unusable_reason,
        "description": ref.description,
    }


@router.get("", response_model=ListObject[ModelObject])
async def list_models(request: Request, team: TeamDep, settings: SettingsDep) -> dict[str, Any]:
    """The built-in and base models, then the team's fine-tuned models and checkpoints."""
    refs = await run_db(request, available_models, team.team_id, settings)
    data = [model_object(r) for r in refs]
    return {
        "object": "list",
        "data": data,
        "has_more": False,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


_CONTENT_RESPONSES: dict[int | str, dict[str, Any]] = {
    **error_responses(400, 404),
    416: {
        "model": ErrorResponse,
        "description": "The `Range` starts at or past the end of the download (`range_not_satisfiable`); "
        "`Content-Range: bytes */LENGTH` gives its length",
    },
    200: {
        "content": {"application/x-tar": {}},
        "description": f"An uncompressed tar; `{CHECKSUM_HEADER}` is its SHA-256",
    },
    206: {
        "content": {"application/x-tar": {}},
        "description": "The byte range asked for by `Range` (one range; `Content-Range` says which)",
    },
}
_SEED_QUERY = Query(
    ge=0,
    le=2**63 - 1,
    description="Built-in models only: the seed of the random init (a job's hyperparameters.seed); "
    "other models ignore it",
)
_FORMAT_QUERY = Query(
    alias="format", description="model: merged weights, config, tokenizer; adapter: the LoRA adapter"
)


@router.head("/{model:path}/content", response_class=Response, responses=_CONTENT_RESPONSES)
@router.get("/{model:path}/content", response_class=StreamingResponse, responses=_CONTENT_RESPONSES)
async def model_content(
    model: str,
    request: Request,
    team: TeamDep,
    settings: SettingsDep,
    fmt: Annotated[dl.DownloadFormat, _FORMAT_QUERY] = "model",
    seed: Annotated[int, _SEED_QUERY] = 0,
) -> Response:
    """Download a model as a tar (its files at the archive's root): a fine-tuned model or checkpoint
    of the team, or a base model it may train on (a folder of the service's model roots, or a built-in
    config's weights at ``seed``: the base an adapter trained with that seed goes onto).

    The tar's bytes are fixed for a model, so a download resumes: ``Range: bytes=START-`` (one range)
    answers 206 with those bytes, ``If-Range`` with the ``ETag`` (or ``Last-Modified``) of the first
    answer makes sure they are of the same archive. ``HEAD`` answers the headers alone."""
    ref, digest = await run_db(request, _download_of, team.team_id, model, settings, fmt)
    folder = _download_folder(ref, fmt)
    if folder is not None:
        return await _send(request, team.team_id, ref, folder, fmt, digest, release=lambda: None)
    # a built-in config: its weights at this seed, from the cache (kept there until they are sent)
    cache: BuiltinCache = request.app.state.builtin_cache
    hold = ExitStack()
    folder = await anyio.to_thread.run_sync(hold.enter_context, cache.folder(ref.id, seed))
    try:
        return await _send(request, team.team_id, ref, folder, fmt, digest, release=hold.close)
    except BaseException:
        await anyio.to_thread.run_sync(hold.close)
        raise


async def _send(
    request: Request,
    team_id: str,
    ref: ModelRef,
    folder: Path,
    fmt: dl.DownloadFormat,
    digest: str | None,
    *,
    release: Callable[[], object],
) -> Response:
    """The download's answer: headers, then (GET) the bytes asked for; ``release`` runs once they
    are sent (at once for HEAD)."""
    members = await anyio.to_thread.run_sync(dl.model_members, folder, fmt)
    mtime = ref.created
    if ref.kind in ("builtin", "base"):  # no row to keep the checksum in: remembered in the process
        digest = await anyio.to_thread.run_sync(dl.base_tar_sha256, members, mtime)
    elif digest is None:  # first download of this model: one read pass, then cached in its row
        digest = await anyio.to_thread.run_sync(dl.tar_sha256, members, mtime)
        await run_db(request, _cache_digest, team_id, ref.id, fmt, digest)
    layout = dl.TarLayout(members, mtime)
    etag, modified = await anyio.to_thread.run_sync(_validators, members, mtime, digest)
    headers = {
        CHECKSUM_HEADER: digest,
        "Accept-Ranges": "bytes",
        "ETag": etag,
        "Last-Modified": http_date(modified),
        "Content-Disposition": f'attachment; filename="{dl.archive_name(ref.id, fmt)}"',
    }
    start, end, status = 0, layout.length, 200
    wanted = _range(request, layout.length, etag, modified, headers)
    if wanted is not None:
        start, end, status = wanted.start, wanted.end, 206
        headers["Content-Range"] = wanted.content_range
    headers["Content-Length"] = str(end - start)
    if request.method == "HEAD":
        await anyio.to_thread.run_sync(release)
        return Response(status_code=status, headers=headers, media_type=TAR)
    body = _then(layout.stream(start, end), release)
    return StreamingResponse(body, status_code=status, media_type=TAR, headers=headers)


def _range(
    request: Request, length: int, etag: str, modified: int, headers: dict[str, str]
) -> ByteRange | None:
    """The one range asked for, if ``If-Range`` (when given) still holds; 416 past the end."""
    if not if_range_holds(request.headers.get("if-range"), etag=etag, last_modified=modified):
        return None
    try:
        return parse_range(request.headers.get("range"), length)
    except RangeNotSatisfiable as exc:
        raise APIError(
            416,
            f"The range '{request.headers.get('range')}' is not within the {length} bytes of this download",
            param="Range",
            code="range_not_satisfiable",
            headers={**headers, "Content-Range": exc.content_range},
        ) from exc


def _then(chunks: Iterator[bytes], release: Callable[[], object]) -> Iterator[bytes]:
    """``chunks``, then ``release`` (also when the client goes away and the stream is dropped)."""
    try:
        yield from chunks
    finally:
        release()


def _validators(members: list[dl.Member], mtime: int, digest: str) -> tuple[str, int]:
    """The download's ETag and Last-Modified (Unix seconds)."""
    return dl.listing_tag(members, mtime, digest), dl.last_modified(members, mtime)


def _download_folder(ref: ModelRef, fmt: dl.DownloadFormat) -> Path | None:
    """The folder to send; None for a built-in config (its folder is written for the seed asked)."""
    if fmt == "adapter" and ref.kind in ("builtin", "base"):
        raise APIError(
            400,
            f"The model '{ref.id}' is a base model: it has no LoRA adapter; download format=model",
            param="format",
            code="no_adapter",
        )
    if fmt == "adapter" and ref.adapter_path is None:
        raise APIError(
            400,
            f"The model '{ref.id}' has no LoRA adapter (it was not trained with LoRA); download format=model",
            param="format",
            code="no_adapter",
        )
    return ref.path  # a base folder's files go through the same allow-list as a fine-tuned model's


def _download_of(
    session: Session, team_id: str, model: str, settings: Settings, fmt: dl.DownloadFormat
) -> tuple[ModelRef, str | None]:
    """The model to download and the tar's cached checksum (None before its first download)."""
    ref = team_model(session, team_id, model, settings)
    row = find_model(session, team_id, ref.id) if ref.kind in ("fine-tuned", "checkpoint") else None
    if row is None:
        return ref, None
    return ref, row.adapter_sha256 if fmt == "adapter" else row.content_sha256


def _cache_digest(session: Session, team_id: str, model_id: str, fmt: dl.DownloadFormat, digest: str) -> None:
    row = find_model(session, team_id, model_id)
    if row is None:
        return
    if fmt == "adapter":
        row.adapter_sha256 = digest
    else:
        row.content_sha256 = digest
    session.commit()


@router.get("/{model:model_id}", response_model=ModelObject, responses=error_responses(400, 404))
async def retrieve_model(
    model: str, request: Request, team: TeamDep, settings: SettingsDep
) -> dict[str, Any]:
    ref = await run_db(request, team_model, team.team_id, model, settings)
    return model_object(await anyio.to_thread.run_sync(shown, ref))


@router.delete(
    "/{model:model_id}", response_model=ModelDeleted, responses=error_responses(400, 403, 404, 409)
)
async def delete_model(model: str, request: Request, team: TeamDep, settings: SettingsDep) -> ModelDeleted:
    """Delete one of the team's fine-tuned models or checkpoints: its files and its id."""
    return await run_db(request, _delete_model, team.team_id, model, settings)


def _delete_model(session: Session, team_id: str, model: str, settings: Settings) -> ModelDeleted:
    ref = team_model(session, team_id, model, settings)
    if ref.kind in ("builtin", "base"):
        raise APIError(
            403,
            f"The model '{ref.id}' is a base model of the service and cannot be deleted",
            param="model",
            code="model_not_deletable",
        )
    row = session.get(RegisteredModel, ref.id, with_for_update=True)
    assert row is not None  # team_model found it
    job = session.get(FineTuningJob, row.job_id)
    if job is not None and not JobStatus(job.status).terminal:
        raise APIError(
            409,
            f"The model '{ref.id}' is a checkpoint of job {job.id}, which is {job.status}; "
            "cancel the job or wait until it finishes",
            param="model",
            code="job_not_finished",
        )
    row.deleted_at = utcnow()
    if row.step_number is not None:
        session.execute(
            delete(JobCheckpoint).where(
                JobCheckpoint.job_id == row.job_id, JobCheckpoint.step_number == row.step_number
            )
        )
    _remove_files(Path(row.path), settings.resolved_jobs_dir)  # an error here leaves the row as it was
    session.commit()
    return ModelDeleted(id=ref.id)


def _remove_files(folder: Path, jobs_dir: Path) -> None:
    """Remove a model's folder, only when it is inside ``jobs_dir`` (whatever a row says)."""
    resolved = folder.resolve()
    if not resolved.is_relative_to(jobs_dir.resolve()) or resolved == jobs_dir.resolve():
        log.warning("model folder %s is not under %s; its files are left alone", folder, jobs_dir)
        return
    if folder.is_dir():
        shutil.rmtree(folder)
        OUTPUT_SIZES.forget(folder.parent)

"""Model ids: a team's fine-tuned models and checkpoints (the ``models`` table), and the base models
found under the configured model roots.

A job's final model is ``ft:<base>:<team>:<suffix>:<job id>`` (OpenAI's shape; the suffix empty when
the job has none) and each checkpoint ``<that id>:ckpt-step-<n>``. ``<base>`` is the short name of the
model the job started from (a built-in name, the last folder of a model-root model, or the base of the
``ft:`` model it continued); every part is reduced to ``[A-Za-z0-9._-]`` so an id never holds a path or a
stray ``:``. Ids are looked up whole, never parsed.

Rows are registered where the worker records results: :func:`register_final` with the job's end
state, :func:`register_checkpoint` / :func:`forget_checkpoint` with its checkpoint rows
(worker.job.writer), each in the caller's transaction.

A base model under a root is named by its folder relative to the root (``org/name``): segments of
``[A-Za-z0-9._-]`` that are not ``.``/``..``, so a name never leaves its root (:func:`base_model_dir`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Container, Iterable, Sequence
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from store.orm import FineTuningJob, ModelKind, RegisteredModel, Team, utcnow

FT_PREFIX = "ft:"
#: Where a job's LoRA adapter sits in its model folder (trainer.run.checkpoint's layout).
ADAPTER_DIR = "adapter"
#: How deep below a root :func:`base_models` looks for model folders (``org/name`` is 2).
MAX_ROOT_DEPTH = 3
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
#: The longest folder name a filesystem takes (Linux's NAME_MAX, in bytes; a name's characters are ASCII).
NAME_MAX = 255
_PART_CHARS = 64


class ModelLookupError(LookupError):
    """A job's model is no longer available (deleted, or its files gone)."""


def id_part(text: str | None) -> str:
    """``text`` as one part of an ``ft:`` id: only ``[A-Za-z0-9._-]``, at most 64 characters."""
    return _UNSAFE.sub("-", text or "").strip("-.")[:_PART_CHARS]


def is_safe_name(name: str) -> bool:
    """Whether ``name`` can be a base model's folder under a root: at most :data:`MAX_ROOT_DEPTH` segments
    (where :func:`base_models` looks), each a folder name a filesystem takes, none leaving the root."""
    segments = name.split("/")
    return (
        bool(name)
        and len(segments) <= MAX_ROOT_DEPTH
        and all(_SEGMENT.match(seg) and len(seg) <= NAME_MAX and seg not in (".", "..") for seg in segments)
    )


def base_model_dir(roots: Sequence[Path], name: str) -> Path | None:
    """The folder of base model ``name`` under the first root that holds it (has a ``config.json``)."""
    if not is_safe_name(name):
        return None
    for root in roots:
        folder = Path(root) / name
        if (folder / "config.json").is_file():
            return folder
    return None


def base_models(roots: Sequence[Path]) -> dict[str, Path]:
    """Every base model under the roots: name (folder relative to its root) -> folder; the first root wins."""
    found: dict[str, Path] = {}
    for root in roots:
        root = Path(root)
        for folder in _model_folders(root, MAX_ROOT_DEPTH):
            name = folder.relative_to(root).as_posix()
            if is_safe_name(name):
                found.setdefault(name, folder)
    return found


def _model_folders(folder: Path, depth: int) -> Iterable[Path]:
    try:
        children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return
    for child in children:
        if (child / "config.json").is_file():
            yield child
        elif depth > 1:
            yield from _model_folders(child, depth - 1)


def find_model(session: Session, team_id: str, model_id: str) -> RegisteredModel | None:
    """The team's model (not deleted) by its id; None for an unknown or another team's id."""
    row = session.get(RegisteredModel, model_id)
    if row is None or row.team_id != team_id or row.deleted_at is not None:
        return None
    return row


def team_models(session: Session, team_id: str) -> list[RegisteredModel]:
    """The team's models and checkpoints (not deleted), oldest first."""
    return list(
        session.scalars(
            select(RegisteredModel)
            .where(RegisteredModel.team_id == team_id, RegisteredModel.deleted_at.is_(None))
            .order_by(RegisteredModel.created_at, RegisteredModel.id)
        )
    )


def _base_of(session: Session, job: FineTuningJob) -> str:
    """The short base name for the ids of ``job``'s models."""
    if job.model.startswith(FT_PREFIX):
        parent = session.get(RegisteredModel, job.model)
        if parent is not None:
            return parent.base_model
    return id_part(Path(job.model.rstrip("/")).name or job.model) or "model"


def job_model_id(session: Session, job: FineTuningJob) -> str:
    """``ft:<base>:<team>:<suffix>:<job id>``."""
    team = session.get(Team, job.team_id)
    team_part = id_part(team.name if team is not None else "") or "team"
    return f"{FT_PREFIX}{_base_of(session, job)}:{team_part}:{id_part(job.suffix)}:{job.id}"


def checkpoint_id(model_id: str, step: int) -> str:
    return f"{model_id}:ckpt-step-{step}"


def _adapter_path(path: str) -> str | None:
    adapter = Path(path) / ADAPTER_DIR
    return str(adapter) if adapter.is_dir() else None


def _upsert(
    session: Session, job: FineTuningJob, model_id: str, kind: ModelKind, path: str, step: int | None
) -> RegisteredModel:
    row = session.get(RegisteredModel, model_id)
    if row is None:
        row = RegisteredModel(
            id=model_id,
            team_id=job.team_id,
            job_id=job.id,
            kind=kind.value,
            base_model=_base_of(session, job),
        )
        session.add(row)
    else:  # recorded again (a resumed run may have rewritten the files; the tar's mtimes change too):
        row.content_sha256 = row.adapter_sha256 = None  # the cached checksums no longer hold
    row.step_number, row.path, row.adapter_path = step, path, _adapter_path(path)
    row.created_at, row.deleted_at = utcnow(), None
    return row


def register_final(session: Session, job: FineTuningJob, path: str) -> RegisteredModel:
    """Record the job's final model folder under its ``ft:`` id and set ``job.fine_tuned_model`` to it."""
    row = _upsert(session, job, job_model_id(session, job), ModelKind.fine_tuned, path, None)
    job.fine_tuned_model = row.id
    return row


def register_checkpoint(session: Session, job_id: str, step: int, path: str) -> str:
    """Record the job's checkpoint at ``step`` (folder ``path``); its ``ft:...:ckpt-step-<n>`` id."""
    job = session.get(FineTuningJob, job_id)
    if job is None:
        raise ModelLookupError(f"no job {job_id}")
    return _upsert(
        session, job, checkpoint_id(job_model_id(session, job), step), ModelKind.checkpoint, path, step
    ).id


def forget_checkpoint(session: Session, job_id: str, step: int) -> None:
    """The checkpoint's files were pruned: its id is gone (deleted now)."""
    for row in session.scalars(
        select(RegisteredModel).where(
            RegisteredModel.job_id == job_id,
            RegisteredModel.step_number == step,
            RegisteredModel.deleted_at.is_(None),
        )
    ):
        row.deleted_at = utcnow()


def forget_job_models(session: Session, job_id: str) -> None:
    """All of a job's outputs were removed (a purge): its models and checkpoints are gone."""
    for row in session.scalars(
        select(RegisteredModel).where(RegisteredModel.job_id == job_id, RegisteredModel.deleted_at.is_(None))
    ):
        row.deleted_at = utcnow()


def spec_model(
    session: Session, team_id: str, model: str, roots: Sequence[Path], builtin: Container[str] = ()
) -> str:
    """What a job's recorded ``model`` names for the trainer: an ``ft:`` id's folder, a model root's
    folder, else the name itself (a ``builtin`` config name, which a root's folder never shadows, or a
    path recorded before model ids existed). Raises :class:`ModelLookupError` when an ``ft:`` id is
    no longer there."""
    if model.startswith(FT_PREFIX):
        row = find_model(session, team_id, model)
        if row is None or not os.path.isdir(row.path):
            raise ModelLookupError(f"The model '{model}' does not exist")
        return row.path
    folder = None if model in builtin else base_model_dir(roots, model)
    return str(folder) if folder is not None else model

"""Which models a team may name, and what each name means: the API's side of model ids.

A team sees the built-in configs (trainer.model.catalog), the base models under ``Settings.model_roots``
(named by folder relative to a root) and its own ``ft:`` models and checkpoints (store.model_ids).
:func:`team_model` turns a name from a request into a :class:`ModelRef`; a name that looks like a
server path (absolute, ``..``, ``~``, a backslash) is a 400 (:class:`InvalidModelName`), anything else
unknown, and every other team's id, the same 404 (:class:`ModelNotFound`). Built-in names win over a
root's folder of the same name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from sqlalchemy.orm import Session

from api.core.errors import APIError
from contract.serving import ServedModel
from store import model_ids as registry
from store.orm import RegisteredModel, Team, as_utc
from store.settings import Settings
from trainer.model.catalog import BUILTIN_MODELS
from trainer.model.folder_check import folder_problem

ModelKind = Literal["builtin", "base", "fine-tuned", "checkpoint"]
#: ``owned_by`` of the models the service offers to every team (OpenAI says "system" for its own).
SYSTEM_OWNER = "system"
MAX_MODEL_NAME = 512


@dataclass(frozen=True)
class ModelRef:
    """A model a team may use, as resolved from its id."""

    id: str
    kind: ModelKind
    #: The folder with config, tokenizer and weights (from_pretrained); None for a built-in random-init config.
    path: Path | None
    #: The LoRA adapter folder of a fine-tuned model or checkpoint trained with LoRA.
    adapter_path: Path | None
    owned_by: str
    #: Unix seconds (0 for the built-in configs).
    created: int
    #: Why a base model's folder cannot be trained on (trainer.model.folder_check: its config, weights
    #: and their shapes, tokenizer), or None: shown as ``usable``/``unusable_reason`` by ``/v1/models``.
    #: Filled by :func:`shown` (listing, retrieve); None until then.
    unusable_reason: str | None = None
    #: What the model is: a built-in's, always; a folder's from its model card, filled by
    #: :func:`shown` (listing, retrieve). None when nothing says.
    description: str | None = None


class ModelNotFound(APIError):
    """404: no such model for this team (unknown and other teams' ids answer the same)."""

    def __init__(self, model: str, *, param: str | None = "model") -> None:
        shown = model if len(model) <= 200 else model[:200] + "..."
        super().__init__(
            404,
            f"The model '{shown}' does not exist or you do not have access to it.",
            param=param,
            code="model_not_found",
        )


class InvalidModelName(APIError):
    """400: a model name that is not a model id (e.g. a server path)."""

    def __init__(self, model: str, reason: str, *, param: str | None = "model") -> None:
        shown = model if len(model) <= 200 else model[:200] + "..."
        super().__init__(400, f"Invalid model '{shown}': {reason}", param=param, code="invalid_model")


def _looks_like_path(name: str) -> bool:
    return (
        name.startswith(("/", "~", "."))
        or "\\" in name
        or "//" in name
        or any(seg in (".", "..") for seg in name.split("/"))
    )


def _ref(row: RegisteredModel, owner: str) -> ModelRef:
    created = as_utc(row.created_at)
    return ModelRef(
        id=row.id,
        kind="checkpoint" if row.kind == "checkpoint" else "fine-tuned",
        path=Path(row.path),
        adapter_path=Path(row.adapter_path) if row.adapter_path else None,
        owned_by=owner,
        created=int(created.timestamp()) if created else 0,
    )


def _base_ref(name: str, folder: Path) -> ModelRef:
    try:
        created = int((folder / "config.json").stat().st_mtime)
    except OSError:
        created = 0
    return ModelRef(
        id=name,
        kind="base",
        path=folder,
        adapter_path=None,
        owned_by=SYSTEM_OWNER,
        created=created,
    )


def _builtin_ref(name: str) -> ModelRef:
    return ModelRef(
        id=name,
        kind="builtin",
        path=None,
        adapter_path=None,
        owned_by=SYSTEM_OWNER,
        created=0,
        description=f"{BUILTIN_MODELS[name].description}. {BUILTIN_RANDOM}",
    )


#: What every built-in config is, said beside its shape.
BUILTIN_RANDOM = "Random weights (from the job's seed): it knows no language; for smoke tests and benchmarks"
#: A model card's description is cut to this many characters.
MAX_DESCRIPTION = 400


def description_of(folder: Path) -> str | None:
    """A model folder's description: the first paragraph of its model card (``README.md``, past the
    YAML front matter and headings), or None."""
    try:
        text = (folder / "README.md").read_text(encoding="utf-8", errors="replace")[:20_000]
    except OSError:
        return None
    if text.startswith("---"):
        end = text.find("\n---", 3)
        text = text[end + 4 :] if end >= 0 else ""
    for block in text.split("\n\n"):
        lines = [ln.strip() for ln in block.strip().splitlines() if not ln.lstrip().startswith("#")]
        paragraph = " ".join(ln for ln in lines if ln)
        if paragraph:
            return (
                paragraph if len(paragraph) <= MAX_DESCRIPTION else paragraph[: MAX_DESCRIPTION - 3] + "..."
            )
    return None


def team_owner(session: Session, team_id: str) -> str:
    """``owned_by`` of a team's models: the team's name."""
    team = session.get(Team, team_id)
    return team.name if team is not None else team_id


def team_model(
    session: Session, team_id: str, model: str, settings: Settings, *, param: str | None = "model"
) -> ModelRef:
    """The model ``model`` names for this team; raises :class:`ModelNotFound` (404) or
    :class:`InvalidModelName` (400), both naming ``param``."""
    if not model or len(model) > MAX_MODEL_NAME or "\x00" in model:
        raise InvalidModelName(
            model.replace("\x00", ""), f"must be 1 to {MAX_MODEL_NAME} characters", param=param
        )
    if model.startswith(registry.FT_PREFIX):
        row = registry.find_model(session, team_id, model)
        if row is None or not os.path.isdir(row.path):
            raise ModelNotFound(model, param=param)
        return _ref(row, team_owner(session, team_id))
    if model in BUILTIN_MODELS:
        return _builtin_ref(model)
    if _looks_like_path(model):
        raise InvalidModelName(
            model,
            "name a built-in model, a base model the service offers (GET /v1/models) "
            "or one of your fine-tuned models, not a server path",
            param=param,
        )
    folder = registry.base_model_dir(settings.model_roots, model)
    if folder is None:
        raise ModelNotFound(model, param=param)
    return _base_ref(model, folder)


def spec_model_name(ref: ModelRef) -> str:
    """What goes into ``JobSpec.model``: the built-in config's name, else the model's folder."""
    return ref.id if ref.path is None else str(ref.path)


def served(ref: ModelRef) -> ServedModel:
    """The model as the engine takes it: its id, what the built-in backend loads, its LoRA adapter."""
    adapter = None if ref.adapter_path is None else str(ref.adapter_path)
    return ServedModel(id=ref.id, source=spec_model_name(ref), adapter_path=adapter)


def shown(ref: ModelRef) -> ModelRef:
    """``ref`` as listing and retrieve show it, with what they read from its folder (a request that only
    uses the model reads neither): a base folder's check (:attr:`ModelRef.unusable_reason`, the check job
    create makes, cached per folder until a file of it changes; headers only, no weights read) and the
    folder's description (:func:`description_of`)."""
    if ref.path is None:
        return ref
    reason = folder_problem(ref.path) if ref.kind == "base" else None
    return replace(ref, unusable_reason=reason, description=description_of(ref.path))


def available_models(session: Session, team_id: str, settings: Settings) -> list[ModelRef]:
    """Every model the team may name: built-in configs, base models under the roots (each with its
    folder's check and description: :func:`shown`), then its own fine-tuned models and checkpoints (oldest
    first)."""
    refs = [_builtin_ref(name) for name in BUILTIN_MODELS]
    refs += [
        shown(_base_ref(name, folder))
        for name, folder in registry.base_models(settings.model_roots).items()
        if name not in BUILTIN_MODELS
    ]
    owner = team_owner(session, team_id)
    refs += [shown(_ref(row, owner)) for row in registry.team_models(session, team_id)]
    return refs

"""What a job asks its tracking integrations for: the request's ``integrations``, shaped as OpenAI's.

``[{"type": "wandb", "wandb": {"project", "name", "entity", "tags"}}]`` as the OpenAI fine-tuning API
takes it, and our ``{"type": "mlflow", "mlflow": {"experiment", "run_name", "tags"}}`` beside it: a
discriminated union on ``type``, so an unknown type is one error naming it. Which types a team may use
is the server's setting (``Settings.allowed_integrations``), checked by the API at create. The job row
stores the list as given (``model_dump(exclude_none=True)``) and the worker reads it back here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

#: The integration types this server implements (the allowed ones are a setting's subset).
INTEGRATION_TYPES = ("wandb", "mlflow")
MAX_INTEGRATIONS = len(INTEGRATION_TYPES)
MAX_TAGS = 32

_Name = Annotated[str, Field(min_length=1, max_length=128)]
_Tag = Annotated[str, Field(min_length=1, max_length=64)]


class WandbSettings(BaseModel):
    """OpenAI's ``wandb`` object: the W&B project, and optionally the run's name, entity and tags."""

    model_config = ConfigDict(extra="forbid")

    project: _Name
    name: _Name | None = None
    entity: _Name | None = None
    tags: list[_Tag] | None = Field(None, max_length=MAX_TAGS)


class WandbIntegration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["wandb"]
    wandb: WandbSettings


class MlflowSettings(BaseModel):
    """The MLflow experiment (created when missing; default ``zenflow``), the run's name and its tags."""

    model_config = ConfigDict(extra="forbid")

    experiment: _Name = "zenflow"
    run_name: _Name | None = None
    tags: dict[_Name, Annotated[str, Field(max_length=5000)]] | None = Field(None, max_length=MAX_TAGS)


class MlflowIntegration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["mlflow"]
    mlflow: MlflowSettings = Field(default_factory=MlflowSettings)


Integration = Annotated[WandbIntegration | MlflowIntegration, Field(discriminator="type")]


def one_of_each(items: list[Any]) -> list[Any]:
    """``items`` when no type appears twice (one run per tracking server and job), else ValueError."""
    seen: set[str] = set()
    for item in items:
        if item.type in seen:
            raise ValueError(f"at most one integration of type {item.type!r}")
        seen.add(item.type)
    return items


_LIST = TypeAdapter(list[Integration])


def parse_stored(rows: list[dict[str, Any]] | None) -> list[WandbIntegration | MlflowIntegration]:
    """The job row's stored integrations, typed (checked at create; an entry this worker does not know,
    from a newer server, raises ValidationError, which the caller reports as a warning)."""
    return list(_LIST.validate_python(rows or []))

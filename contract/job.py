"""A job as asked (:class:`JobRequest`) and as decided (:class:`ResolvedJob`, inside a :class:`Resolution`
that says when, why and for which machine it was decided).

A job is resolved once, when it is created, for the machine its plan fits (trainer.resolve). A run that
must decide again (a worker whose machine differs from the one planned for, a checkpoint that pins the
engine's mode, data that counts differently) records a new resolution beside the first: the job's
resolutions are a list, the last one current, the first one what was decided at create.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from contract.engine import EngineRequest, ResolvedEngine
from contract.hyperparameters import HyperparametersRequest, ResolvedHyperparameters
from contract.method import MethodRequest, ResolvedMethod, SupervisedMethod
from contract.resources import Resources
from contract.values import Dtype

#: Where a resolved value came from:
#:
#: - ``request``: the job's request gave it;
#: - ``model``: the base model's own default (a built-in model's measured zenflow settings, the default
#:   learning rate of its kind);
#: - ``default``: the service's default (the contract's field default);
#: - ``data``: a rule over the training data (epochs and batch size from the example count, the steps);
#: - ``plan``: the memory and speed plan for the machine (engine mode, accumulator, micro-batch, ...);
#: - ``resume``: kept as the checkpoint the run resumes from has it.
Source = Literal["request", "model", "default", "data", "plan", "resume"]


class JobRequest(BaseModel):
    """What the client asked for: the model, the files, and the settings it gave (the others unset, so
    their resolution says ``default``, ``model``, ``data`` or ``plan``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    """The base model: an API model id, a built-in config name or (the job library) a local folder."""
    training_file: str
    """A file id (the API) or a path (the job library)."""
    validation_file: str | None = None
    method: MethodRequest = Field(default_factory=SupervisedMethod)
    hyperparameters: HyperparametersRequest = Field(default_factory=HyperparametersRequest)
    engine: EngineRequest = Field(default_factory=EngineRequest)
    resources: Resources = Field(default_factory=Resources)


class ResolvedJob(BaseModel):
    """Every setting of a job, concrete, with the source of each (:meth:`flat`'s paths as keys)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: ResolvedMethod
    hyperparameters: ResolvedHyperparameters
    engine: ResolvedEngine
    resources: Resources
    dtype: Dtype
    """The parameters' dtype: bfloat16 on a GPU, float32 on a CPU."""
    sources: dict[str, Source] = Field(default_factory=dict)
    """Where each value came from, by its path (``engine.mode``, ``hyperparameters.n_epochs``)."""

    def flat(self) -> dict[str, Any]:
        """Each value by its dotted path (``engine.mode``); a LoRA adapter's settings as one value."""
        out: dict[str, Any] = {"dtype": self.dtype}
        for part in ("method", "hyperparameters", "engine", "resources"):
            for key, value in getattr(self, part).model_dump(mode="json").items():
                out[f"{part}.{key}"] = value
        return out

    def changes(self, before: ResolvedJob) -> dict[str, dict[str, Any]]:
        """The values that differ from ``before``'s: ``{path: {"from": old, "to": new}}``."""
        old, new = before.flat(), self.flat()
        return {k: {"from": old.get(k), "to": v} for k, v in new.items() if old.get(k) != v}


class PlanOutcome(BaseModel):
    """What the plan behind a resolution said, in brief (the whole plan is the job's plan event)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fits: bool
    summary: str
    step_seconds: float
    device_bytes: int
    host_bytes: int


class Resolution(BaseModel):
    """One decision of a job's settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    at: Literal["create", "run"]
    """When: at the job's create, or by a run that had to decide again."""
    reason: str
    """Why it was decided (again)."""
    decided_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    machine: dict[str, Any] | None = None
    """The machine it was planned for (trainer.plan.gpus.Machine's fields); None: no plan could be made."""
    num_examples: int
    """Training examples counted (after those the data options drop)."""
    num_tokens: int | None = None
    """Their tokens, when counted."""
    plan: PlanOutcome | None = None
    job: ResolvedJob


#: A job row's resolutions (the last one current).
RESOLUTIONS = TypeAdapter(list[Resolution])

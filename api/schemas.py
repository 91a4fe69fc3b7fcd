"""Request and response bodies in the shape of the OpenAI files and fine-tuning API (plus our extras).

Responses parse with the official ``openai`` SDK's types; requests accept what the SDK sends.
Extras live beside the OpenAI fields: ``engine`` (the engine's public settings, contract.engine) and
``resources`` (contract.resources) in a create; on a job its settings as resolved (``hyperparameters``,
``method``, ``engine``, ``resources``: every value concrete once decided), where each came from
(``sources``) and when and why they were decided (``resolutions``), ``queue_position`` and ``progress``;
the per-step metrics list. No object shows a path on the server (events: api.jobs.public_paths).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema, field_validator

from contract.engine import EngineRequest
from contract.graders import AnyGrader, Grader
from contract.resources import Resources
from store.orm import as_utc
from worker.tracking.integrations import MAX_INTEGRATIONS, Integration, one_of_each

T = TypeVar("T")


def unix(dt: datetime | None) -> int | None:
    """Unix seconds of a stored timestamp (SQLite hands back naive UTC values)."""
    dt = as_utc(dt)
    return None if dt is None else int(dt.timestamp())


# --- "auto" or a positive number, with one clean error per field (no union-member noise) ---------


def _auto_or_number(kind: type, *, positive: bool = True) -> Callable[[Any], Any]:
    name = "an integer" if kind is int else "a number"

    def check(v: Any) -> Any:
        if v == "auto":
            return "auto"
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"must be 'auto' or {name}")
        if kind is int:
            if isinstance(v, float) and not v.is_integer():
                raise ValueError(f"must be 'auto' or {name}")
            v = int(v)
        else:
            v = float(v)
            if not math.isfinite(v):
                raise ValueError("must be a finite number")
        if positive and v <= 0:
            raise ValueError("must be greater than 0")
        return v

    return check


_AUTO_INT_SCHEMA = {"anyOf": [{"const": "auto"}, {"type": "integer", "exclusiveMinimum": 0}]}
_AUTO_FLOAT_SCHEMA = {"anyOf": [{"const": "auto"}, {"type": "number", "exclusiveMinimum": 0}]}
AutoPosInt = Annotated[int | str, PlainValidator(_auto_or_number(int)), WithJsonSchema(_AUTO_INT_SCHEMA)]
AutoPosFloat = Annotated[
    float | str, PlainValidator(_auto_or_number(float)), WithJsonSchema(_AUTO_FLOAT_SCHEMA)
]


class HyperparametersIn(BaseModel):
    """The OpenAI three; the trainer's further knobs (learning_rate, warmup, lr_scheduler, max_steps,
    eval_every, checkpoint_every, max_seq_length, lora, ...) pass through and are checked by its JobSpec."""

    model_config = ConfigDict(extra="allow")

    n_epochs: AutoPosInt = "auto"
    batch_size: AutoPosInt = "auto"
    learning_rate_multiplier: AutoPosFloat = "auto"


class SupervisedIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hyperparameters: HyperparametersIn | None = None


class DpoHyperparametersIn(HyperparametersIn):
    """OpenAI's DPO hyperparameters: the supervised ones plus ``beta`` (the KL penalty's weight; ``auto``
    is 0.1, trainer.method.dpo.AUTO_DPO_BETA); the trainer's further knobs pass through as for supervised."""

    beta: AutoPosFloat = "auto"


class DpoIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hyperparameters: DpoHyperparametersIn | None = None


class ReinforcementHyperparametersIn(HyperparametersIn):
    """OpenAI's reinforcement hyperparameters: the supervised ones (``batch_size`` counts prompts), plus
    ``compute_multiplier`` (completions per prompt: 8 x it), ``eval_interval`` (steps between validations;
    our ``eval_every``), ``eval_samples`` (completions per validation prompt) and ``reasoning_effort``
    (recorded; a model without a reasoning mode ignores it); our extras ``max_completion_tokens``,
    ``temperature`` and ``kl_beta`` (contract.method.ReinforcementMethod) and the trainer's further knobs
    pass through."""

    compute_multiplier: AutoPosFloat = "auto"
    eval_interval: AutoPosInt = "auto"
    eval_samples: AutoPosInt = "auto"
    reasoning_effort: Literal["default", "low", "medium", "high"] = "default"


class ReinforcementIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grader: Grader
    hyperparameters: ReinforcementHyperparametersIn | None = None


class MethodIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["supervised", "dpo", "reinforcement"] = Field(
        description="Supervised fine-tuning (chat or prompt/completion data), DPO (preference pairs: "
        "input, preferred_output, non_preferred_output) or reinforcement (prompts and a grader: GRPO)."
    )
    supervised: SupervisedIn | None = None
    dpo: DpoIn | None = None
    reinforcement: ReinforcementIn | None = None


Metadata = dict[str, str]


class JobCreate(BaseModel):
    """``POST /v1/fine_tuning/jobs``: the OpenAI parameters plus our ``engine`` and ``resources`` extras."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=512)
    training_file: str = Field(min_length=1, max_length=64)
    validation_file: str | None = Field(None, max_length=64)
    hyperparameters: HyperparametersIn | None = None
    method: MethodIn | None = None
    suffix: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9._-]*$")
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    metadata: Metadata | None = None
    #: Tracking integrations (OpenAI's ``wandb``, our ``mlflow``; worker.tracking.integrations); the types a team
    #: may use are the server's ``allowed_integrations``.
    integrations: list[Integration] | None = Field(None, max_length=MAX_INTEGRATIONS)
    #: The engine's public settings (our extra, contract.engine.EngineRequest): ``mode``, ``accumulate_on``
    #: and ``shard_params`` also ``auto`` (the job's plan decides); unset fields take the model's or the
    #: contract's defaults. Another field (a worker's tuning) is refused, named.
    engine: EngineRequest | None = None
    #: What the job needs from its workers (our extra, contract.resources.Resources): ``gpus`` ranks on each
    #: of ``nodes`` worker hosts (default 1 and 1).
    resources: Resources | None = None

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, v: Metadata | None) -> Metadata | None:
        if v is None:
            return v
        if len(v) > 16:
            raise ValueError("at most 16 keys")
        for k, val in v.items():
            if len(k) > 64:
                raise ValueError(f"key {k[:20]!r}...: at most 64 characters")
            if len(val) > 512:
                raise ValueError(f"value of {k!r}: at most 512 characters")
        return v

    @field_validator("integrations")
    @classmethod
    def _one_integration_per_type(cls, v: list[Integration] | None) -> list[Integration] | None:
        return one_of_each(v) if v else v


# --- responses -------------------------------------------------------------------------------------


FileStatus = Literal["uploaded", "processed", "error"]


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: FileStatus = "processed"
    expires_at: int | None = None
    status_details: str | None = None
    #: Extras: what the validator found, and the content digest.
    num_examples: int | None = None
    sha256: str | None = None
    #: Extra: the records' format as the upload's check found it (``chat`` and ``prompt_completion``
    #: train supervised jobs, ``preference`` DPO, ``reinforcement`` reinforcement); null for a file
    #: uploaded before the format was kept.
    format: Literal["chat", "prompt_completion", "preference", "reinforcement"] | None = None
    #: Upload response only, when the upload named a ``model``: the data checked with that model's
    #: tokenizer (api.jobs.data_check.upload_summary: tokens, truncated and dropped examples with lines).
    validation: dict[str, Any] | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class HyperparametersObject(BaseModel):
    """OpenAI's three, then every other hyperparameter: the resolved values once the job is resolved
    (learning_rate, max_seq_length, lora, warmup_steps, total_steps, ...), the request's before
    (api.jobs.views.job_hyperparameters)."""

    model_config = ConfigDict(extra="allow")

    n_epochs: int | str | None = "auto"
    batch_size: int | str | None = "auto"
    learning_rate_multiplier: float | str | None = "auto"


class SupervisedOut(BaseModel):
    hyperparameters: HyperparametersObject


class ReinforcementOut(BaseModel):
    grader: dict[str, Any]
    hyperparameters: HyperparametersObject


class MethodOut(BaseModel):
    """OpenAI's ``method``: the key of the job's type only (the other is left out, not null)."""

    type: Literal["supervised", "dpo", "reinforcement"] = "supervised"
    supervised: SupervisedOut | None = Field(None, exclude_if=lambda v: v is None)
    #: A DPO job's hyperparameters (``beta`` resolved among them).
    dpo: SupervisedOut | None = Field(None, exclude_if=lambda v: v is None)
    #: A reinforcement job's grader and hyperparameters (its own settings resolved among them).
    reinforcement: ReinforcementOut | None = Field(None, exclude_if=lambda v: v is None)


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class ResolutionObject(BaseModel):
    """One decision of a job's settings (contract.job.Resolution): at create, or by a run that had to
    decide again, and what it changed from the one before."""

    at: Literal["create", "run"]
    reason: str
    decided_at: int
    #: The machine it was planned for (a GPU's name and its share of the host), or null (no plan).
    planned_for: str | None = None
    #: The plan's summary (fits, mode, memory, predicted s/step), or null.
    plan: str | None = None
    #: ``{"engine.mode": {"from": "zenflow", "to": "offload"}}`` against the previous resolution.
    changes: dict[str, dict[str, Any]] = Field(default_factory=dict)


class Progress(BaseModel):
    step: int = 0
    total_steps: int | None = None
    attempts: int = 0


# A fine-tuning job as the API returns it (its row: ``store.orm.FineTuningJob``).
class FineTuningJobObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    finished_at: int | None = None
    model: str
    fine_tuned_model: str | None = None
    organization_id: str
    status: Literal["validating_files", "queued", "running", "paused", "succeeded", "failed", "cancelled"]
    hyperparameters: HyperparametersObject
    method: MethodOut
    training_file: str
    validation_file: str | None = None
    result_files: list[str] = Field(default_factory=list)
    trained_tokens: int | None = None
    error: JobError | None = None
    seed: int
    suffix: str | None = None
    user_provided_suffix: str | None = None
    metadata: dict[str, str] | None = None
    estimated_finish: int | None = None
    integrations: list[Integration] = Field(default_factory=list)
    # Extras.
    #: The engine's settings: resolved (every value concrete) once the job is, else the request's.
    engine: dict[str, Any] = Field(default_factory=dict)
    resources: Resources = Field(default_factory=Resources)
    #: Where each resolved value came from, by path (``engine.mode``: ``plan``; ``hyperparameters.n_epochs``:
    #: ``data``): request, model, default, data, plan or resume (contract.job.Source); empty until resolved.
    sources: dict[str, str] = Field(default_factory=dict)
    #: Each decision of the settings, the first at create, the last current.
    resolutions: list[ResolutionObject] = Field(default_factory=list)
    queue_position: int | None = None
    cancel_requested: bool = False
    #: A pause of the running job is pending: it stops at its next step and becomes ``paused``.
    pause_requested: bool = False
    progress: Progress = Field(default_factory=Progress)


# One event of a job (its row: ``store.orm.JobEvent``).
class JobEventObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    type: Literal["message", "metrics"] = "message"
    data: dict[str, Any] | None = None


class CheckpointMetrics(BaseModel):
    model_config = ConfigDict(extra="allow")

    step: float | None = None
    train_loss: float | None = None
    train_mean_token_accuracy: float | None = None
    valid_loss: float | None = None
    valid_mean_token_accuracy: float | None = None
    full_valid_loss: float | None = None
    full_valid_mean_token_accuracy: float | None = None


# One checkpoint of a job (its row: ``store.orm.JobCheckpoint``).
class JobCheckpointObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    step_number: int
    metrics: CheckpointMetrics


class StepMetric(BaseModel):
    """One training step of a job (our extra, from JobStepMetric rows)."""

    object: Literal["fine_tuning.job.metric"] = "fine_tuning.job.metric"
    step: int
    created_at: int
    train_loss: float | None = None
    valid_loss: float | None = None
    lr: float | None = None
    tokens_per_second: float | None = None
    step_seconds: float
    stall_seconds: float
    stall_fraction: float
    gpu_utilization: float | None = None
    cpu_optimizer_seconds: float
    bytes_device_to_host: int
    bytes_host_to_device: int
    method_metrics: dict[str, Any] | None = Field(
        default=None,
        description="A reinforcement job's step figures: reward_mean, reward_min, reward_max, samples, "
        "completion_tokens_mean, truncated_fraction, grader_errors, grader_error_flags, sub_rewards, "
        "generation_seconds, grading_seconds, rollout_tokens_per_second; a DPO job's: chosen_reward, "
        "rejected_reward, reward_margin, accuracy (null for supervised steps).",
    )


class ListObject(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


# --- errors and health -----------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    """The OpenAI error object. ``type`` is ``invalid_request_error`` for 4xx, ``server_error`` for 5xx."""

    message: str
    type: Literal["invalid_request_error", "server_error"]
    param: str | None = Field(
        None, description="The parameter at fault (a field path such as hyperparameters.n_epochs)"
    )
    code: str | None = Field(
        None, description="Machine-readable reason, e.g. invalid_value, not_found, invalid_api_key"
    )
    #: Upload validation (invalid_file_format) also names the first failing field and lists the errors.
    field: str | None = Field(None, description="Upload validation: the first field at fault")
    errors: list[dict[str, Any]] | None = Field(
        None, description="Upload validation: up to 20 of {line, field, message, detail}"
    )


class ErrorResponse(BaseModel):
    """Every failure: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


class ReadinessCheck(BaseModel):
    status: Literal["ok", "unavailable"]
    seconds: float | None = None
    error: str | None = None


class Readiness(BaseModel):
    status: Literal["ok", "unavailable"]
    checks: dict[str, ReadinessCheck]


class QuotaLimits(BaseModel):
    """A team's limits (null = unlimited)."""

    max_running_jobs: int | None = Field(
        description="Jobs of the team running at once (more wait their turn)"
    )
    max_queued_jobs: int | None = Field(description="Jobs of the team waiting at once (a create beyond: 429)")
    gpu_hours: float | None = Field(description="GPU-hours per rolling period (a create beyond: 429)")
    storage_bytes: int | None = Field(
        description="Bytes stored: files, results, job outputs (a create beyond: 400)"
    )


class QuotaUsage(BaseModel):
    """What the team uses now."""

    running_jobs: int
    queued_jobs: int
    gpu_hours: float = Field(description="GPU-hours used in the current rolling period")
    storage_bytes: int


class QuotaObject(BaseModel):
    """``GET /v1/quotas``: the calling team's quota limits and its usage (our extra)."""

    object: Literal["organization.quota"] = "organization.quota"
    organization_id: str
    period_days: float = Field(description="The rolling window of the gpu_hours quota")
    limits: QuotaLimits
    usage: QuotaUsage
    #: The limits that are the team's own; the others are the server's defaults.
    custom: list[str]


class ModelObject(BaseModel):
    """``GET /v1/models/{id}``: OpenAI's model object, plus ``kind`` (ours)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    kind: Literal["builtin", "base", "fine-tuned", "checkpoint"] = Field(
        description="builtin: a random-init config; base: under the service's model roots; fine-tuned, "
        "checkpoint: the team's own (ft: ids, downloadable at /v1/models/{id}/content)"
    )
    usable: bool = Field(
        True,
        description="Whether a job can train on it: false for a base model whose folder fails the check "
        "job create makes (config, weights and their shapes, tokenizer); create answers 400 invalid_model",
    )
    unusable_reason: str | None = Field(
        None, description="Why it is not usable (the check's message), null when usable"
    )
    description: str | None = Field(
        None,
        description="What the model is: a built-in's shape and that its weights are random; a base's or a "
        "fine-tuned model's first paragraph of its model card (README.md); null when none says",
    )


class ModelDeleted(BaseModel):
    id: str
    object: Literal["model"] = "model"
    deleted: bool = True


# --- graders (/v1/fine_tuning/alpha/graders): OpenAI's GraderValidateParams, GraderRunParams, responses --

#: A run's sample and item, at most (the body limit bounds both too).
MAX_MODEL_SAMPLE_CHARS = 256 * 1024


class GraderValidateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grader: AnyGrader


class GraderRunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grader: AnyGrader
    model_sample: str = Field(max_length=MAX_MODEL_SAMPLE_CHARS)
    """The model's output: the ``sample`` namespace (``output_json`` when it parses as JSON)."""
    item: dict[str, Any] = Field(default_factory=dict)
    """The dataset row: the ``item`` namespace."""


class GraderValidateObject(BaseModel):
    grader: dict[str, Any]


class GraderRunMetadata(BaseModel):
    name: str
    type: str
    errors: dict[str, Any]
    """Every flag of OpenAI's ``metadata.errors`` (``trainer.graders.result.GraderErrors``)."""
    execution_time: float
    scores: dict[str, Any]
    token_usage: int | None = None
    sampled_model_name: str | None = None


class GraderRunObject(BaseModel):
    reward: float
    metadata: GraderRunMetadata
    sub_rewards: dict[str, Any]
    model_grader_token_usage_per_model: dict[str, Any]

"""What one fine-tuning job is: :class:`JobSpec` and its hyperparameters.

``"auto"`` values are resolved by :meth:`Hyperparameters.resolve` once the number of training
examples is known; the resolved record (:class:`ResolvedHyperparameters`) is written into the job
(``fine_tuning_jobs.resolved_hyperparameters``) and into every checkpoint, so a resumed run uses the
same numbers. This module does not import torch (the API builds and validates specs).

Resolution rules for ``auto``:

- ``n_epochs``: 3, raised so that epochs x examples >= 100 (at most 25 epochs), lowered so that
  it stays <= 25,000 (at least 1).
- ``batch_size``: ``clamp(num_examples // 100, 4, 32)``, never more than the number of examples.
- ``learning_rate``: the model's default (built-in configs carry their own; local checkpoints 1e-5,
  2e-4 with LoRA), times ``learning_rate_multiplier`` (``auto`` = 1.0).
- ``warmup``: 5% of the steps. An int is a number of steps, a float in [0, 1) a ratio.
- ``max_seq_length``: the model's maximum, capped at 2048.
- ``eval_every``: about 10 evaluations per run when there is a validation file, else disabled.
- ``checkpoint_every``: about 5 checkpoints per run (and always one at the end).
- ``micro_batch_size``, ``gradient_checkpointing``, ``packing``: :func:`trainer.runtime.resolve_runtime`.

Bounds: every number is finite and bounded on construction (no count above ``MAX_COUNT``, the
largest a job's step counters hold in the database). The service's configurable limits and the checks
of values that would only fail once the job runs are :mod:`trainer.limits`, run when a job is created.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from offload.config import EngineConfig, EngineMode
from trainer.data.chat_format import SystemMessage
from trainer.data.dataset import Truncation
from trainer.method import DpoSpec, LoraSpec, Method, packing_error
from trainer.runtime import RUNTIME_FIELDS, ResolvedRuntime, RuntimeChoices, RuntimeRequest, resolve_runtime

Auto = Literal["auto"]

#: The largest step, epoch, batch or length count a job may have: its step counters are 32-bit
#: integer columns in the database.
MAX_COUNT = 2**31 - 1
#: The largest batch size ``"auto"`` resolves to (:meth:`Hyperparameters.resolve`: 1% of the examples,
#: at least 4 and at most this, never more than the examples there are).
AUTO_BATCH_MAX = 32


class EngineSettings(EngineConfig):
    """EngineConfig fields a job may set: everything but ``lr`` (hyperparameters.learning_rate).

    ``mode`` (default) and ``accumulate_on`` also take ``auto``, resolved by the job's plan
    (:mod:`trainer.plan.planner`): ``device`` when the optimizer state fits the device with room (LoRA, small
    models), else ``zenflow``; the engine itself only knows explicit values.
    """

    mode: Literal["auto", "device", "offload", "zenflow"] = "auto"  # type: ignore[assignment]
    """device: AdamW on the device; offload: the CPU AdamW every step, the device waiting; zenflow: the
    important columns on the device every step, the rest on the CPU in the background; auto: the plan's
    choice (device when its optimizer state fits the device with room, else zenflow)."""
    accumulate_on: Literal["host", "device", "auto"] = "host"  # type: ignore[assignment]
    """Where zenflow sums a window's unselected gradient: host (no device memory), device (an fp32
    accumulator on the device, less CPU work per step), or auto: the plan's choice."""
    shard_params: Literal["auto"] | bool = "auto"  # type: ignore[assignment]
    """Shard the weights, gradients and optimizer state over the job's ranks with PyTorch FSDP2, each rank
    holding 1/N (true), or keep a whole copy of the weights on every rank (false); auto: the plan's choice
    (sharded when the replicated weights do not fit the device, which costs the all-gathers' and
    reduce-scatters' traffic per step). One rank never shards."""

    @field_validator("lr")
    @classmethod
    def _no_lr(cls, v: float) -> float:
        raise ValueError("set hyperparameters.learning_rate instead of engine.lr")

    def engine_config(
        self,
        lr: float,
        *,
        mode: EngineMode | None = None,
        accumulate_on: Literal["host", "device"] | None = None,
        shard_params: bool = False,
    ) -> EngineConfig:
        """The offload.config.EngineConfig to build the engine with; ``mode`` / ``accumulate_on``
        resolve an ``auto`` (the plan's choice; without one ``auto`` is zenflow / host); ``shard_params``: the
        run's resolved choice (:func:`trainer.run.sharding.resolve_shard_params`)."""
        fields = self.model_dump(exclude={"lr"})
        if self.mode == "auto":
            fields["mode"] = mode or "zenflow"
        if self.accumulate_on == "auto":
            fields["accumulate_on"] = accumulate_on or "host"
        fields["shard_params"] = shard_params
        return EngineConfig(**{**fields, "lr": lr})


#: The most ranks (GPUs) one job may ask for.
MAX_GPUS_PER_JOB = 64
#: Most worker hosts (nodes) one job may span: a gang of that many workers (store.gang).
MAX_NODES_PER_JOB = 16


class ResourceSpec(BaseModel):
    """What a job needs from its workers. ``gpus``: data-parallel ranks per node, one per GPU (CPU ranks
    on gloo where the worker allows them); ``nodes``: worker hosts the job spans, each running ``gpus``
    ranks (a gang, store.gang). Each optimizer step's ``batch_size`` examples are split across all
    ``nodes`` x ``gpus`` ranks."""

    model_config = ConfigDict(extra="forbid")

    gpus: int = Field(1, ge=1, le=MAX_GPUS_PER_JOB)
    nodes: int = Field(1, ge=1, le=MAX_NODES_PER_JOB)

    @property
    def world_size(self) -> int:
        """All ranks of the job: ``nodes`` x ``gpus``."""
        return self.nodes * self.gpus


class ResolvedHyperparameters(ResolvedRuntime):
    """Concrete values a run uses; recorded in the job and the checkpoints."""

    model_config = ConfigDict(extra="forbid")

    n_epochs: int
    batch_size: int
    learning_rate: float
    base_learning_rate: float
    learning_rate_multiplier: float
    warmup_steps: int
    lr_scheduler: Literal["cosine", "linear", "constant"]
    min_lr_ratio: float
    max_seq_length: int
    eval_every: int | None
    checkpoint_every: int
    seed: int
    num_examples: int
    steps_per_epoch: int
    total_steps: int
    #: Data options (defaults for checkpoints made before they existed); see Hyperparameters.
    truncation: Truncation = "truncate"
    system_message: SystemMessage = "keep"
    #: The LoRA adapter trained (None: full fine-tuning); part of the training signature.
    lora: LoraSpec | None = None
    #: DPO with its beta resolved (None: supervised); part of the training signature.
    dpo: DpoSpec | None = None

    def lr_at(self, step: int) -> float:
        """Learning rate for the update with 0-based index ``step``: linear warm-up, then decay."""
        peak = self.learning_rate
        if step < self.warmup_steps:
            return peak * (step + 1) / self.warmup_steps
        if self.lr_scheduler == "constant":
            return peak
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.lr_scheduler == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return peak * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * factor)

    def training_signature(self) -> dict[str, Any]:
        """The fields a checkpoint must agree with to be resumed exactly."""
        return self.model_dump(exclude={"eval_every", "checkpoint_every", *RUNTIME_FIELDS})


class Hyperparameters(RuntimeRequest):
    """Requested hyperparameters (OpenAI names where they exist), each number or ``"auto"``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    n_epochs: int | Auto = "auto"
    batch_size: int | Auto = "auto"
    learning_rate: float | Auto = "auto"
    learning_rate_multiplier: float | Auto = "auto"
    #: Warm-up: an int is a number of steps, a float in [0, 1) a fraction of the total steps.
    warmup: int | float | Auto = "auto"
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    #: The decayed learning rate ends at this fraction of the peak.
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    max_seq_length: int | Auto = "auto"
    #: Stop after this many steps in all (None: n_epochs full epochs).
    max_steps: int | None = Field(None, ge=1, le=MAX_COUNT)
    #: Validation loss every N steps (and at the end); None or 0 disables it.
    eval_every: int | Auto | None = "auto"
    #: A resumable checkpoint every N steps (and always at the end).
    checkpoint_every: int | Auto = "auto"
    seed: int = Field(0, ge=0, le=2**63 - 1)
    #: Examples over max_seq_length: "truncate" to it (as OpenAI does; one left without a learned token
    #: is dropped), "drop" them, or "error" (the job fails naming the lines). Counted in the job's events.
    truncation: Truncation = "truncate"
    #: System (and developer) messages: "keep" them for the chat template, or "fold" them into the start
    #: of the next user message (for templates without a system role, e.g. Gemma-2's).
    system_message: SystemMessage = "keep"
    #: LoRA through peft (None: full fine-tuning); ``hyperparameters.lora`` in YAML specs and the API alike.
    lora: LoraSpec | None = None
    #: Preference tuning (DPO) instead of supervised: ``method: {"type": "dpo"}`` in the API. The data is
    #: then OpenAI's preference format (trainer.data.preference).
    dpo: DpoSpec | None = None

    @property
    def method(self) -> Method:
        """The fine-tuning method: ``dpo`` when :attr:`dpo` is set."""
        return "dpo" if self.dpo is not None else "supervised"

    @field_validator(
        "n_epochs",
        "batch_size",
        "max_seq_length",
        "max_steps",
        "eval_every",
        "checkpoint_every",
        "seed",
        mode="before",
    )
    @classmethod
    def _no_bool(cls, v: object) -> object:
        # bool is an int subclass: True would silently become 1.
        if isinstance(v, bool):
            raise ValueError("must be an integer, not a boolean")
        return v

    @field_validator("n_epochs", "batch_size", "max_seq_length", "checkpoint_every")
    @classmethod
    def _positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 1 <= v <= MAX_COUNT:
            raise ValueError(f"must be an integer in [1, {MAX_COUNT}] or 'auto'")
        return v

    @field_validator("learning_rate", "learning_rate_multiplier")
    @classmethod
    def _positive_float(cls, v: float | str) -> float | str:
        if not isinstance(v, str) and v <= 0:
            raise ValueError("must be > 0 or 'auto'")
        return v

    @field_validator("warmup")
    @classmethod
    def _warmup(cls, v: int | float | str) -> int | float | str:
        if isinstance(v, bool):
            raise ValueError("must be a number of steps, a ratio in [0, 1), or 'auto'")
        if isinstance(v, int) and not 0 <= v <= MAX_COUNT:
            raise ValueError(f"steps must be in [0, {MAX_COUNT}]")
        if isinstance(v, float) and not 0 <= v < 1:
            raise ValueError("a ratio must be in [0, 1); give an integer for a number of steps")
        return v

    @model_validator(mode="after")
    def _dpo_unpacked(self) -> Hyperparameters:
        if self.dpo is not None and self.packing is True:
            raise packing_error(type(self).__name__, self.packing)
        return self

    @field_validator("eval_every")
    @classmethod
    def _eval_every(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and not 0 <= v <= MAX_COUNT:
            raise ValueError(f"must be in [1, {MAX_COUNT}], 0/null (disabled) or 'auto'")
        return None if v == 0 else v

    def resolve(
        self,
        num_examples: int,
        *,
        base_learning_rate: float,
        model_max_length: int = 2048,
        has_validation: bool = False,
        planned: RuntimeChoices | None = None,
    ) -> ResolvedHyperparameters:
        """Concrete values for a training set of ``num_examples`` examples (``planned``: a plan's
        runtime choices for the ``auto`` ones)."""
        if num_examples < 1:
            raise ValueError("num_examples must be >= 1")
        if self.n_epochs == "auto":
            n_epochs = 3
            if n_epochs * num_examples < 100:
                n_epochs = min(25, math.ceil(100 / num_examples))
            elif n_epochs * num_examples > 25_000:
                n_epochs = max(1, 25_000 // num_examples)
        else:
            n_epochs = self.n_epochs
        if self.batch_size == "auto":
            batch_size = min(num_examples, max(4, min(AUTO_BATCH_MAX, num_examples // 100)))
        else:
            batch_size = min(self.batch_size, num_examples)
        base_lr = base_learning_rate if self.learning_rate == "auto" else self.learning_rate
        mult = 1.0 if self.learning_rate_multiplier == "auto" else self.learning_rate_multiplier
        steps_per_epoch = math.ceil(num_examples / batch_size)
        total = n_epochs * steps_per_epoch
        if self.max_steps is not None:
            total = min(total, self.max_steps)
        if self.warmup == "auto":
            warmup = round(0.05 * total)
        elif isinstance(self.warmup, float):
            warmup = round(self.warmup * total)
        else:
            warmup = self.warmup
        warmup = min(warmup, total)
        max_len = min(model_max_length, 2048) if self.max_seq_length == "auto" else self.max_seq_length
        if self.eval_every == "auto":
            eval_every = max(1, math.ceil(total / 10)) if has_validation else None
        else:
            eval_every = self.eval_every
        ckpt = max(1, math.ceil(total / 5)) if self.checkpoint_every == "auto" else self.checkpoint_every
        if total > MAX_COUNT:
            raise ValueError(f"{total} training steps: more than a job can run ({MAX_COUNT})")
        return ResolvedHyperparameters(
            n_epochs=n_epochs,
            batch_size=batch_size,
            learning_rate=base_lr * mult,
            base_learning_rate=base_lr,
            learning_rate_multiplier=mult,
            warmup_steps=warmup,
            lr_scheduler=self.lr_scheduler,
            min_lr_ratio=self.min_lr_ratio,
            max_seq_length=max_len,
            eval_every=eval_every,
            checkpoint_every=ckpt,
            seed=self.seed,
            num_examples=num_examples,
            steps_per_epoch=steps_per_epoch,
            total_steps=total,
            truncation=self.truncation,
            system_message=self.system_message,
            lora=self.lora,
            dpo=self.dpo.resolved() if self.dpo is not None else None,
            **self._runtime(batch_size, planned).model_dump(),
        )

    def _runtime(self, batch_size: int, planned: RuntimeChoices | None) -> RuntimeChoices:
        """The runtime choices; DPO never packs (see ``_dpo_unpacked``), whatever a plan proposes."""
        chosen = resolve_runtime(self, batch_size, planned)
        return chosen.model_copy(update={"packing": False}) if self.dpo is not None else chosen


class JobSpec(BaseModel):
    """One fine-tuning job: base model, data, hyperparameters, engine settings, LoRA, output."""

    model_config = ConfigDict(extra="forbid")

    #: A built-in config name (``tiny-llama``, ``small-llama``) or a local Hugging Face directory.
    model: str
    #: The name others know the base model by (the API's model id, e.g. ``org/base-model``), written
    #: into the adapter's ``base_model_name_or_path`` and the model card; None: ``model`` itself (a
    #: folder: its name), never a server path (trainer.run.model_card.base_model_id).
    model_name: str | None = None
    training_file: Path
    validation_file: Path | None = None
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)
    #: offload.config.EngineConfig fields (mode, ZenFlow knobs); the learning rate comes from the
    #: hyperparameters, so ``engine.lr`` is refused. Fields left unset take the model's defaults
    #: (built-in models carry measured ZenFlow settings), then EngineConfig's.
    engine: EngineSettings = Field(default_factory=EngineSettings)
    #: Where checkpoints and the final model go (required by run_training).
    output_dir: Path | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    #: Parameter dtype: auto = bfloat16 on CUDA (every mode keeps fp32 master weights), float32 on CPU.
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    #: Resumable checkpoints kept on disk (older ones are deleted); None keeps all.
    keep_checkpoints: int | None = Field(3, ge=1)
    #: Ranks (GPUs) the job runs on.
    resources: ResourceSpec = Field(default_factory=ResourceSpec)

    @model_validator(mode="before")
    @classmethod
    def _lora_alias(cls, raw: Any) -> Any:
        """Top-level ``lora`` (the old place; :func:`load_spec` warns about it) moves to ``hyperparameters.lora``."""
        if not isinstance(raw, dict) or "lora" not in raw:
            return raw
        raw = dict(raw)
        lora, hp = raw.pop("lora"), raw.get("hyperparameters") or {}
        if isinstance(hp, Hyperparameters):
            hp = hp.model_dump(exclude_unset=True)
        if not isinstance(hp, dict):
            return raw  # the field's own validation reports it
        if hp.get("lora") is not None and lora is not None:
            raise ValueError("lora is given twice: keep hyperparameters.lora and remove the top-level lora")
        return {**raw, "hyperparameters": {**hp, "lora": lora if lora is not None else hp.get("lora")}}

    @property
    def lora(self) -> LoraSpec | None:
        """``hyperparameters.lora``: the LoRA settings, None for full fine-tuning."""
        return self.hyperparameters.lora

    @property
    def dpo(self) -> DpoSpec | None:
        """``hyperparameters.dpo``: the DPO settings, None for supervised fine-tuning."""
        return self.hyperparameters.dpo

    @model_validator(mode="before")
    @classmethod
    def _model_engine_defaults(cls, raw: Any) -> Any:
        """Fill the engine fields the job leaves unset with the model's own defaults (built-in
        random-init configs carry measured ZenFlow settings; see trainer.model.catalog.default_engine_settings)."""
        if not isinstance(raw, dict) or not isinstance(raw.get("model"), str):
            return raw
        engine = raw.get("engine")
        if isinstance(engine, EngineConfig):
            engine = engine.model_dump(exclude_unset=True)
        if engine is not None and not isinstance(engine, dict):
            return raw  # the field's own validation reports it
        from trainer.model.catalog import UnknownModelError, default_engine_settings

        try:
            filled = default_engine_settings(raw["model"], dict(engine or {}))
        except (UnknownModelError, OSError):
            return raw  # the model field's validator reports it
        return {**raw, "engine": filled}

    @field_validator("model")
    @classmethod
    def _known_model(cls, v: str) -> str:
        from trainer.model.catalog import resolve_model

        resolve_model(v)  # UnknownModelError (a ValueError) naming it -> ValidationError at "model"
        return v

    def resolve(self, num_examples: int, planned: RuntimeChoices | None = None) -> ResolvedHyperparameters:
        """Resolve the hyperparameters with this model's defaults (and a plan's runtime choices)."""
        from trainer.model.catalog import default_learning_rate, model_max_length

        return self.hyperparameters.resolve(
            num_examples,
            base_learning_rate=default_learning_rate(self.model, lora=self.lora is not None),
            model_max_length=model_max_length(self.model),
            has_validation=self.validation_file is not None,
            planned=planned,
        )


def load_spec(path: str | Path, *, output_dir: str | Path | None = None) -> JobSpec:
    """Read a YAML (or JSON) spec. Relative data and model paths are relative to the spec file;
    ``output_dir`` (argument, spec, else ``runs/<spec name>``) is relative to the current directory."""
    path = Path(path)
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    if "lora" in raw:
        warnings.warn(
            f"{path}: top-level 'lora' is deprecated; put it under 'hyperparameters:' as 'lora:' "
            "(the same place as in the API)",
            FutureWarning,
            stacklevel=2,
        )
    base = path.parent
    for key in ("training_file", "validation_file"):
        if raw.get(key) is not None and not Path(raw[key]).expanduser().is_absolute():
            raw[key] = str((base / raw[key]).resolve())
    model = raw.get("model")
    if isinstance(model, str) and not Path(model).is_absolute() and (base / model / "config.json").is_file():
        raw["model"] = str((base / model).resolve())
    if output_dir is not None:
        raw["output_dir"] = str(output_dir)
    raw.setdefault("output_dir", str(Path("runs") / path.stem))
    raw["output_dir"] = str(Path(raw["output_dir"]).expanduser().resolve())
    return JobSpec.model_validate(raw)


def spec_from_job(
    *,
    model: str,
    training_file: str | Path,
    validation_file: str | Path | None,
    hyperparameters: dict[str, Any] | None,
    engine: dict[str, Any] | None,
    seed: int | None,
    output_dir: str | Path,
    resources: dict[str, Any] | None = None,
    model_name: str | None = None,
) -> JobSpec:
    """A JobSpec from a job row's values (fine_tuning_jobs columns + the files' storage paths).

    ``hyperparameters`` is the job's requested dict (its ``"lora"`` key: {r, alpha, dropout,
    target_modules}, or null). ``seed`` (the job's column) wins over a seed inside the dict. Raises pydantic.ValidationError (its ``loc`` names the field) or
    UnknownModelError.
    """
    hp = dict(hyperparameters or {})
    if seed is not None:
        hp["seed"] = seed
    return JobSpec.model_validate(
        {
            "model": model,
            "model_name": model_name,
            "training_file": str(training_file),
            "validation_file": str(validation_file) if validation_file else None,
            "hyperparameters": hp,
            "engine": dict(engine or {}),
            "output_dir": str(output_dir),
            "resources": dict(resources or {}),
        }
    )

"""What the job library runs: a :class:`JobSpec`, a job's request (the contract's types: method,
hyperparameters, engine, resources) with where its files are and where its outputs go.

A spec is the request only: its ``auto`` values and everything it leaves unset are decided by
:mod:`trainer.resolve` into a :class:`contract.job.Resolution` (at create in the service, at the start of a
run of ``zenflow train``). This module does not import torch (the API builds and validates specs).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from contract.engine import EngineRequest
from contract.hyperparameters import HyperparametersRequest
from contract.job import JobRequest
from contract.lora import LoraSpec
from contract.method import DpoMethod, MethodRequest, SupervisedMethod
from contract.resources import Resources


class JobSpec(BaseModel):
    """One fine-tuning job as the library runs it: base model, data, the requested settings, output."""

    model_config = ConfigDict(extra="forbid")

    #: A built-in config name (``tiny-llama``, ``small-llama``) or a local Hugging Face directory.
    model: str
    #: The name others know the base model by (the API's model id, e.g. ``org/base-model``), written
    #: into the adapter's ``base_model_name_or_path`` and the model card; None: ``model`` itself (a
    #: folder: its name), never a server path (trainer.run.model_card.base_model_id).
    model_name: str | None = None
    training_file: Path
    validation_file: Path | None = None
    method: MethodRequest = Field(default_factory=SupervisedMethod)
    hyperparameters: HyperparametersRequest = Field(default_factory=HyperparametersRequest)
    #: The public engine settings (contract.engine.EngineRequest); the learning rate is the hyperparameters'.
    engine: EngineRequest = Field(default_factory=EngineRequest)
    resources: Resources = Field(default_factory=Resources)
    #: The engine's tuning for this machine (offload.config.TUNING_FIELDS: CPU threads, chunk sizes, ...):
    #: a worker's settings (``ZENFLOW_ENGINE_TUNING``) or a local spec's, never part of a job's request.
    engine_tuning: dict[str, Any] = Field(default_factory=dict)
    #: Where checkpoints and the final model go (required by run_training).
    output_dir: Path | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    #: Parameter dtype: auto = bfloat16 on CUDA (every mode keeps fp32 master weights), float32 on CPU.
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    #: Resumable checkpoints kept on disk (older ones are deleted); None keeps all.
    keep_checkpoints: int | None = Field(3, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _earlier_places(cls, raw: Any) -> Any:
        """Settings given where earlier specs had them: a top-level ``lora`` (now ``hyperparameters.lora``;
        :func:`load_spec` warns) and ``hyperparameters.dpo`` (now ``method: {type: dpo, beta}``)."""
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        hp = raw.get("hyperparameters") or {}
        if isinstance(hp, BaseModel):
            hp = hp.model_dump(exclude_unset=True)
        if not isinstance(hp, dict):
            return raw  # the field's own validation reports it
        hp = dict(hp)
        if "lora" in raw:
            lora = raw.pop("lora")
            if hp.get("lora") is not None and lora is not None:
                raise ValueError(
                    "lora is given twice: keep hyperparameters.lora and remove the top-level lora"
                )
            hp["lora"] = lora if lora is not None else hp.get("lora")
        if "dpo" in hp:
            dpo = hp.pop("dpo")
            if dpo is not None:
                if raw.get("method") is not None:
                    raise ValueError("DPO is given twice: keep method and remove hyperparameters.dpo")
                raw["method"] = {"type": "dpo", **(dpo if isinstance(dpo, dict) else {})}
        if "hyperparameters" in raw or hp:
            raw["hyperparameters"] = hp
        return raw

    @model_validator(mode="after")
    def _dpo_unpacked(self) -> JobSpec:
        """DPO scores each completion in a row of its own: its rows are never packed."""
        if self.dpo is not None and self.hyperparameters.packing is True:
            message = "DPO scores each completion in a row of its own: packing must be false or 'auto'"
            raise ValidationError.from_exception_data(
                type(self).__name__,
                [
                    InitErrorDetails(
                        type=PydanticCustomError("value_error", message),
                        loc=("hyperparameters", "packing"),
                        input=True,
                    )
                ],
            )
        return self

    @field_validator("model")
    @classmethod
    def _known_model(cls, v: str) -> str:
        from trainer.model.catalog import find_model

        find_model(v)  # UnknownModelError (a ValueError) naming it -> ValidationError at "model"
        return v

    @field_validator("engine_tuning")
    @classmethod
    def _tuning(cls, v: dict[str, Any]) -> dict[str, Any]:
        from offload.config import check_tuning

        check_tuning(v)  # each value within its bounds, the error naming the field
        return v

    @property
    def lora(self) -> LoraSpec | None:
        """``hyperparameters.lora``: the LoRA settings, None for full fine-tuning."""
        return self.hyperparameters.lora

    @property
    def dpo(self) -> DpoMethod | None:
        """The DPO method's request, None for another method."""
        return self.method if isinstance(self.method, DpoMethod) else None

    def request(self) -> JobRequest:
        """The spec's request (what was asked; the fields it left unset stay unset)."""
        fields = {"model", "method", "hyperparameters", "engine", "resources"} & self.model_fields_set
        return JobRequest(
            training_file=str(self.training_file),
            validation_file=str(self.validation_file) if self.validation_file else None,
            **{"model": self.model, **{k: getattr(self, k) for k in fields}},
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


def spec_of_request(
    request: JobRequest,
    *,
    model: str,
    training_file: str | Path,
    validation_file: str | Path | None,
    output_dir: str | Path,
    model_name: str | None = None,
    engine_tuning: dict[str, Any] | None = None,
) -> JobSpec:
    """The JobSpec of a stored request (the service's): its settings as given, with ``model`` the base
    model's folder or built-in name and the files' storage paths."""
    given = request.model_fields_set & {"method", "hyperparameters", "engine", "resources"}
    return JobSpec.model_validate(
        {
            "model": model,
            "model_name": model_name,
            "training_file": str(training_file),
            "validation_file": str(validation_file) if validation_file else None,
            **{k: getattr(request, k) for k in given},
            "engine_tuning": dict(engine_tuning or {}),
            "output_dir": str(output_dir),
        }
    )

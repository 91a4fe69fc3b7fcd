"""The API's calls into trainer/: the dataset validator, the model registry, the job spec's checks,
and the job queue.

trainer.data, trainer.models and trainer.spec do not import torch (tests/test_trainer_spec.py::
test_light_imports), so they are imported here at start-up. The queue's sending side
(``trainer.worker.broker``, which imports Celery) is imported on the first enqueue: an app given its
own ``enqueue`` (tests, benchmarks) never loads it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from api.errors import APIError, validation_error
from offload.config import EngineConfig
from trainer.data import DatasetValidationError, validate_file
from trainer.models import BuiltinModel, UnknownModelError
from trainer.models import resolve_model as resolve_trainer_model
from trainer.spec import Hyperparameters, spec_from_job

log = logging.getLogger(__name__)

MAX_REPORTED_ERRORS = 20


def _format_dataset_errors(errors: list[dict[str, Any]], fallback: str) -> str:
    """``line 3: messages[1].role: unknown role 'bot' ...; ...`` (the validator's messages name both)."""
    parts = [str(e.get("message") or e.get("detail") or "invalid") for e in errors[:5]]
    if len(errors) > 5:
        parts.append(f"and {len(errors) - 5} more")
    return "; ".join(parts) or fallback


def validate_dataset(path: Path, *, param: str = "file") -> int:
    """Run the trainer's validator on an uploaded file; the number of examples, or a 400 naming the field."""
    try:
        report = validate_file(path)
    except DatasetValidationError as exc:
        errors = [dict(e) for e in (getattr(exc, "errors", None) or [])]
        first_field = next((e.get("field") for e in errors if e.get("field")), None)
        raise APIError(
            400,
            "Invalid fine-tuning file: " + _format_dataset_errors(errors, str(exc)),
            param=param,
            code="invalid_file_format",
            extra={"field": first_field, "errors": errors[:MAX_REPORTED_ERRORS]},
        ) from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise APIError(400, f"Invalid fine-tuning file: {exc}", param=param, code="invalid_file_format") from exc
    return report.num_examples


def resolve_model(name: str) -> str:
    """The name a job records for a base model the trainer knows, or a 400 on ``model``."""
    try:
        m = resolve_trainer_model(name)
    except UnknownModelError as exc:
        raise APIError(400, f"Model {name!r} is not available for fine-tuning: {exc}", param="model",
                       code="model_not_found") from exc
    except OSError as exc:  # not a usable local path either (e.g. a name too long for the filesystem)
        raise APIError(400, f"Model {name[:100]!r} is not available for fine-tuning: {exc.strerror or exc}",
                       param="model", code="model_not_found") from exc
    return m.name if isinstance(m, BuiltinModel) else str(m)


def check_job_spec(
    *,
    model: str,
    training_file: Path,
    validation_file: Path | None,
    hyperparameters: dict[str, Any],
    hyperparameters_param: str,
    engine: dict[str, Any],
    seed: int,
    output_dir: Path,
) -> None:
    """Build the trainer's JobSpec from the request so that every field is checked before any write;
    a refusal is a 400 whose ``param`` is the field path (``hyperparameters.max_steps``, ``engine.lr``)."""
    try:
        spec_from_job(
            model=model, training_file=training_file, validation_file=validation_file,
            hyperparameters=hyperparameters, engine=engine, seed=seed, output_dir=output_dir,
        )
    except ValidationError as exc:
        errors = []
        for e in exc.errors():
            loc = list(e.get("loc", ()))
            if loc and loc[0] == "hyperparameters" and hyperparameters_param != "hyperparameters":
                loc = [*hyperparameters_param.split("."), *loc[1:]]
            errors.append({**e, "loc": tuple(loc)})
        fields = set(EngineConfig.model_fields) | set(Hyperparameters.model_fields)
        raise validation_error(errors, fields=fields) from exc


def enqueue(job_id: str, queue: str) -> None:
    """The default ``Enqueue``: send the job's run message to ``queue``'s workers."""
    from trainer.worker import broker

    broker.enqueue_job(job_id, queue=queue)

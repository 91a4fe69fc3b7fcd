"""The API's calls into trainer/: the dataset validator, the job spec's checks, and the job queue
(which models a job may name: api.model_names).

trainer.data.dataset, trainer.model.catalog and trainer.spec do not import torch (tests/trainer/test_spec.py::
test_light_imports), so they are imported here at start-up. The queue's sending side
(``worker.broker``, which imports Celery) is imported on the first enqueue: an app given its
own ``enqueue`` (tests, benchmarks) never loads it. The check of LoRA ``target_modules`` builds the
model on torch's meta device (trainer.model.lora.lora_target_problems), so the first job that names target
modules imports torch in the API process (seconds, once; the module table is cached per model).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from api.core.errors import APIError, validation_error
from contract.engine import EngineRequest
from contract.hyperparameters import HyperparametersRequest
from contract.job import JobRequest
from contract.lora import LoraSpec
from contract.resources import Resources
from store.settings import Settings
from trainer.data.dataset import DatasetReport, DatasetValidationError, ExampleLimits, validate_file
from trainer.data.jsonl import error_summary
from trainer.limits import JobLimits, LimitError, limit_errors
from trainer.model.folder_check import ModelFolderError
from trainer.model.folder_check import check_model_folder as check_folder
from trainer.resolve import AUTO_BATCH_MAX, resolve_hyperparameters
from trainer.spec import JobSpec

log = logging.getLogger(__name__)

MAX_REPORTED_ERRORS = 20


def _format_dataset_errors(errors: list[dict[str, Any]], fallback: str) -> str:
    """``line 3: messages[1].role: unknown role 'bot' ...; ...`` (the validator's messages name both)."""
    return error_summary(errors) or fallback


def public_errors(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A dataset's errors as a 400 lists them: ``{line, field, message}``, the ``detail`` (the problem
    alone) left out where ``message`` (``line 3: messages: <detail>``) already says it, so a client that
    shows both does not print the text twice; at most ``MAX_REPORTED_ERRORS``."""
    out = []
    for e in errors[:MAX_REPORTED_ERRORS]:
        shown = dict(e)
        if str(shown.get("detail") or "") in str(shown.get("message") or ""):
            shown.pop("detail", None)
        out.append(shown)
    return out


def validate_dataset(
    path: Path, *, param: str = "file", limits: ExampleLimits | None = None
) -> DatasetReport:
    """Run the trainer's validator on an uploaded file (the bounds of one example that need no tokenizer:
    messages, characters); its report (the number of examples, the records' format), or a 400 naming
    the field."""
    try:
        report = validate_file(path, limits=limits)
    except DatasetValidationError as exc:
        errors = [dict(e) for e in (getattr(exc, "errors", None) or [])]
        first_field = next((e.get("field") for e in errors if e.get("field")), None)
        raise APIError(
            400,
            "Invalid fine-tuning file: " + _format_dataset_errors(errors, str(exc)),
            param=param,
            code="invalid_file_format",
            extra={"field": first_field, "errors": public_errors(errors)},
        ) from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise APIError(
            400, f"Invalid fine-tuning file: {exc}", param=param, code="invalid_file_format"
        ) from exc
    return report


def check_model_folder(folder: Path | None, name: str) -> None:
    """A base model folder's config, weights and tokenizer (trainer.model.folder_check: read, no weights
    loaded), or a 400 on ``model`` naming the cause; nothing to check for a built-in config (None)."""
    if folder is None:
        return
    try:
        check_folder(folder)
    except ModelFolderError as exc:
        raise APIError(
            400,
            f"Model {name[:200]!r} cannot be fine-tuned: {exc.problem}",
            param="model",
            code="invalid_model",
        ) from exc


def check_integrations(integrations: list[Any] | None, settings: Settings) -> list[dict[str, Any]] | None:
    """The request's integrations (typed by api.schemas.JobCreate) as the job row stores them, or a 400
    naming ``integrations[N].type`` when the server does not allow that type (``allowed_integrations``)."""
    if not integrations:
        return None
    allowed = settings.allowed_integrations
    for i, item in enumerate(integrations):
        if item.type not in allowed:
            offered = ", ".join(repr(t) for t in allowed) if allowed else "none"
            raise APIError(
                400,
                f"integrations[{i}].type: integration type {item.type!r} is not allowed on this server "
                f"(allowed: {offered})",
                param=f"integrations[{i}].type",
                code="invalid_value",
            )
    return [item.model_dump(mode="json", exclude_none=True) for item in integrations]


def job_limits(settings: Settings) -> JobLimits:
    """The trainer's JobLimits from the service settings (``ZENFLOW_MAX_TOTAL_STEPS``, ...)."""
    return JobLimits(**{name: getattr(settings, name) for name in JobLimits.model_fields})


def request_loc(loc: tuple[Any, ...], hyperparameters_param: str) -> tuple[Any, ...]:
    """A spec location as the request spells it: hyperparameters (and the LoRA settings, which the
    request gives inside them) under ``hyperparameters_param``; DPO's beta beside them there."""
    where = hyperparameters_param.split(".")
    if loc[:1] == ("method",) and len(loc) > 1 and loc[-1] == "beta":
        return (*where, "beta")  # given beside the others (the union's tag in between)
    if loc and loc[0] == "hyperparameters":
        return (*where, *loc[1:])
    if loc and loc[0] == "lora":
        return (*where, *loc)
    return loc


#: Names a settings error may lead with (``select_interval: must be ...``), to point ``param`` at them.
_FIELDS = (
    set(EngineRequest.model_fields) | set(HyperparametersRequest.model_fields) | set(LoraSpec.model_fields)
)


def check_job_spec(
    *,
    model: str,
    training_file: Path,
    validation_file: Path | None,
    method: dict[str, Any],
    hyperparameters: dict[str, Any],
    hyperparameters_param: str,
    engine: EngineRequest | None,
    resources: Resources | None,
    seed: int,
    output_dir: Path,
    limits: JobLimits | None = None,
    num_examples: int | None = None,
) -> JobSpec:
    """Build the trainer's JobSpec of the request so that every field is checked before any write
    (returned, for the job's resolution); a refusal is a 400 whose ``param`` is the field path as the
    request spells it (``method.supervised.hyperparameters.max_steps``, ``engine.topk_ratio``).

    With ``limits``, the service's bounds are checked too (trainer.limits.limit_errors: totals from
    ``num_examples``, the training file's count; LoRA target modules against the model's modules); each
    of the job's ranks needs at least one example of every optimizer step (:func:`rank_batch_errors`).
    """
    try:
        spec = JobSpec.model_validate(
            {
                "model": model,
                "training_file": str(training_file),
                "validation_file": str(validation_file) if validation_file else None,
                "method": method,
                "hyperparameters": {**hyperparameters, "seed": seed},
                **({"engine": engine} if engine is not None else {}),
                **({"resources": resources} if resources is not None else {}),
                "output_dir": str(output_dir),
            }
        )
    except ValidationError as exc:
        errors = [
            {**e, "loc": request_loc(tuple(e.get("loc", ())), hyperparameters_param)} for e in exc.errors()
        ]
        raise validation_error(errors, fields=_FIELDS) from exc
    refused = limit_errors(spec, limits, num_examples=num_examples) if limits is not None else []
    refused = refused or rank_batch_errors(spec, num_examples) or micro_batch_errors(spec, num_examples)
    if refused:
        errors = [
            {"loc": request_loc(r.loc, hyperparameters_param), "msg": r.message, "type": "value_error"}
            for r in refused
        ]
        raise validation_error(errors, fields=_FIELDS)
    return spec


def job_request(spec: JobSpec, *, model: str, training_file: str, validation_file: str | None) -> JobRequest:
    """What the job's row keeps of its request: the API's model id, the files' ids, and the settings the
    request gave (only those: what it left unset a resolution says came from elsewhere)."""
    given = spec.model_fields_set & {"method", "hyperparameters", "engine", "resources"}
    return JobRequest(
        model=model,
        training_file=training_file,
        validation_file=validation_file,
        **{k: getattr(spec, k) for k in given},
    )


def _resolved_batch(spec: JobSpec, num_examples: int) -> int | None:
    try:
        return resolve_hyperparameters(spec, num_examples)[0].batch_size
    except ValueError:  # more steps than a job can run: refused elsewhere
        return None


def rank_batch_errors(spec: JobSpec, num_examples: int | None) -> list[LimitError]:
    """A job on N ranks splits each optimizer step's batch across them: refuse a batch smaller than N
    (given, or resolved from ``num_examples``: never more than the examples there are)."""
    gpus = spec.resources.world_size
    if gpus <= 1:
        return []
    batch = spec.hyperparameters.batch_size
    ranks = "resources.gpus" if spec.resources.nodes == 1 else "resources.nodes x resources.gpus"
    need = f"at least {ranks} ({gpus}): each rank needs one example or more per optimizer step"
    if isinstance(batch, int) and batch < gpus:
        return [LimitError(("hyperparameters", "batch_size"), f"is {batch}; it must be {need}")]
    resolved = _resolved_batch(spec, num_examples) if num_examples else None
    if resolved is None or resolved >= gpus:
        return []
    if not isinstance(batch, int):
        return [
            LimitError(
                ("hyperparameters", "batch_size"),
                f"'auto' resolves to {resolved} for {num_examples} examples; give a batch size of {need}",
            )
        ]
    return [
        LimitError(
            ("training_file",),
            f"has {num_examples} examples, so each step's batch is {resolved}; it must be {need}",
        )
    ]


def micro_batch_errors(spec: JobSpec, num_examples: int | None) -> list[LimitError]:
    """An explicit ``micro_batch_size`` over a ``batch_size`` of ``"auto"`` (one over an explicit batch
    size is the spec's own validation error): refused against what ``auto`` resolves to for the training
    file's ``num_examples``, else against the most it can resolve to (``AUTO_BATCH_MAX``). The run
    itself would clamp it to the batch size silently; at create the request is answered instead."""
    hp = spec.hyperparameters
    micro = hp.micro_batch_size
    if not isinstance(micro, int) or isinstance(hp.batch_size, int):
        return []
    resolved = _resolved_batch(spec, num_examples) if num_examples else None
    if num_examples and resolved is None:
        return []
    if resolved is not None:
        batch, what = resolved, f"'auto' resolves to {resolved} for {num_examples} examples"
    else:
        batch, what = AUTO_BATCH_MAX, f"'auto' is at most {AUTO_BATCH_MAX}"
    if micro <= batch:
        return []
    return [
        LimitError(
            ("hyperparameters", "micro_batch_size"),
            f"must be at most batch_size (sequences of one forward/backward, out of the examples of one "
            f"optimizer step); batch_size {what}: give a batch_size of {micro} or more, or a smaller "
            "micro_batch_size",
        )
    ]


def job_queue(gpus: int, settings: Settings) -> str:
    """The queue of a job on ``gpus`` ranks (worker.broker.queue_for_gpus): the default queue
    for one GPU, its ``-x<gpus>`` queue for more (only then is the broker module imported)."""
    if gpus <= 1:
        return settings.default_queue
    from worker.broker import queue_for_gpus

    return queue_for_gpus(gpus, settings.default_queue)


def enqueue(job_id: str, queue: str) -> None:
    """The default ``Enqueue``: send the job's run message to ``queue``'s workers."""
    from worker import broker

    broker.enqueue_job(job_id, queue=queue)

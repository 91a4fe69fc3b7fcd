"""Training data checked with a model: every example rendered with the model's chat template and
tokenized, as the run will (trainer.data.dataset.validate_file with the model's tokenizer).

At job creation both files are checked with the job's model and data options (``max_seq_length``,
``truncation``, ``system_message``): a template that refuses an example, a tool list the template
cannot render, or an over-long example under ``truncation: "error"`` is a 400 naming the file's
parameter and the lines, before anything is written. At upload the same check runs when the upload
names a ``model`` (form field), and its counts (truncated, dropped, with line numbers) come back in
the file object's ``validation``.

Reports are cached per (file path, size, mtime, model, options) and tokenizers per model, so a file
checked at upload or by an earlier job is not tokenized again. Loading a tokenizer imports
transformers (seconds, once per API process).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from api.core.errors import APIError
from trainer.data.dataset import DataOptions, DatasetReport, DatasetValidationError, validate_file
from trainer.spec import Hyperparameters, JobSpec

#: Errors listed in a 400's ``errors`` (the message shows the first five).
MAX_REPORTED_ERRORS = 20


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=8)
def _tokenizer(model: str, stamp: tuple[int, int] | None) -> Any:
    from trainer.model.catalog import load_tokenizer

    return load_tokenizer(model)


def _model_stamp(model: str) -> tuple[int, int] | None:
    config = Path(model) / "config.json"
    return _stamp(config) if config.is_file() else None


@functools.lru_cache(maxsize=64)
def _report(
    path: str, stamp: tuple[int, int], model: str, max_len: int, options: DataOptions
) -> DatasetReport:
    tokenizer = _tokenizer(model, _model_stamp(model))
    return validate_file(
        path, tokenizer=tokenizer, max_seq_length=max_len, options=options, max_errors=MAX_REPORTED_ERRORS
    )


def data_max_length(model: str, hyperparameters: Hyperparameters) -> int:
    """The max_seq_length examples are cut at (resolved as the run resolves it: it does not depend on
    the example count)."""
    from trainer.model.catalog import model_max_length

    return hyperparameters.resolve(
        1, base_learning_rate=1.0, model_max_length=model_max_length(model)
    ).max_seq_length


def check_file(
    path: Path, model: str, hyperparameters: Hyperparameters, *, param: str, code: str
) -> DatasetReport:
    """The file's report with ``model``'s tokenizer; a 400 (``param``, ``code``) naming the lines."""
    options = DataOptions.of(hyperparameters)
    max_len = data_max_length(model, hyperparameters)
    try:
        return _report(str(path), _stamp(path), model, max_len, options)
    except DatasetValidationError as exc:
        errors = [dict(e) for e in exc.errors]
        shown = "; ".join(str(e["message"]) for e in errors[:5]) + (
            f"; and {len(errors) - 5} more" if len(errors) > 5 else ""
        )
        first_field = next((e["field"] for e in errors if e.get("field")), None)
        raise APIError(
            400,
            f"Invalid {param} for model {Path(model).name!r}: {shown}",
            param=param,
            code=code,
            extra={"field": first_field, "errors": errors[:MAX_REPORTED_ERRORS]},
        ) from exc
    except (OSError, ValueError) as exc:  # the model's tokenizer cannot be loaded
        raise APIError(
            400,
            f"Model {Path(model).name!r}: its tokenizer cannot be loaded ({exc})",
            param="model",
            code="invalid_model",
        ) from exc


def check_job_data(spec: JobSpec) -> None:
    """Render and tokenize the job's training and validation files with its model (see the module
    docstring); a 400 ``invalid_training_file`` / ``invalid_validation_file`` naming the lines."""
    files = [("training_file", spec.training_file), ("validation_file", spec.validation_file)]
    for param, path in files:
        if path is not None:
            check_file(Path(path), spec.model, spec.hyperparameters, param=param, code=f"invalid_{param}")


def upload_summary(report: DatasetReport, model_id: str) -> dict[str, Any]:
    """The ``validation`` object of an upload that named a model."""
    d = report.as_dict()
    d.pop("path")
    return {"model": model_id, **d, "summary": report.cut_summary() or None}

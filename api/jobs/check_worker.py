"""The side of a data check that runs in a check process (api.jobs.check_pool): one file rendered and
tokenized with a model's tokenizer (trainer.data.dataset.validate_file), stopped between two lines
once its request no longer wants it (its flag is set: the client left, the server is stopping) or its
time budget has run out.

This module imports the job library only (no web framework): it is what a check process loads.
Tokenizers are cached per model in each process (loading one imports transformers, seconds, once).
The outcome is a plain dict (pickled back to the API process):

- ``{"outcome": "ok", "report": DatasetReport.as_dict()}``;
- ``{"outcome": "invalid", "errors": [DataError, ...]}``: the lines' problems;
- ``{"outcome": "model_error", "message": ...}``: the model's tokenizer cannot be loaded;
- ``{"outcome": "stopped", "reason": "timeout" | "cancelled"}``.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.data.dataset import (
    CheckStopped,
    DataOptions,
    DatasetValidationError,
    ExampleLimits,
    validate_file,
)

#: Errors listed in a 400's ``errors`` (the message shows the first five).
MAX_REPORTED_ERRORS = 20

#: The flags of the process's pool (set by :func:`init_process`): index ``slot`` nonzero = stop.
_FLAGS: Any = None


@dataclass(frozen=True)
class CheckRequest:
    """One file to check with one model, as the run will see it."""

    path: str
    model: str
    max_seq_length: int
    options: DataOptions
    limits: ExampleLimits
    #: Seconds the check may take from its start in the check process.
    budget_seconds: float


def init_process(flags: Any) -> None:
    """Initializer of a check process: keep the shared stop flags, import the data path now."""
    global _FLAGS
    _FLAGS = flags
    import trainer.model.catalog  # noqa: F401


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=8)
def _tokenizer(model: str, stamp: tuple[int, int] | None) -> Any:
    from trainer.model.catalog import load_tokenizer

    return load_tokenizer(model)


def tokenizer_for(model: str) -> Any:
    """``model``'s tokenizer, cached in this process until its ``config.json`` changes (raises OSError or
    ValueError when it cannot be loaded)."""
    return _tokenizer(model, _stamp(Path(model) / "config.json"))


def run_check(slot: int, request: CheckRequest) -> dict[str, Any]:
    """Check ``request`` (see the module docstring); ``slot`` is this check's stop flag."""
    deadline = time.monotonic() + request.budget_seconds

    def stop() -> bool:
        return bool(_FLAGS is not None and _FLAGS[slot]) or time.monotonic() > deadline

    if stop():
        return _stopped(slot)
    try:
        tokenizer = tokenizer_for(request.model)
    except (OSError, ValueError) as exc:  # ModelFolderError is a ValueError
        return {"outcome": "model_error", "message": str(exc)}
    try:
        report = validate_file(
            request.path,
            tokenizer=tokenizer,
            max_seq_length=request.max_seq_length,
            options=request.options,
            max_errors=MAX_REPORTED_ERRORS,
            limits=request.limits,
            stop=stop,
        )
    except CheckStopped:
        return _stopped(slot)
    except DatasetValidationError as exc:
        return {"outcome": "invalid", "errors": [dict(e) for e in exc.errors]}
    return {"outcome": "ok", "report": report.as_dict()}


def _stopped(slot: int) -> dict[str, Any]:
    cancelled = _FLAGS is not None and _FLAGS[slot]
    return {"outcome": "stopped", "reason": "cancelled" if cancelled else "timeout"}

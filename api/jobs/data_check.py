"""Training data checked with a model: every example rendered with the model's chat template and
tokenized, as the run will (trainer.data.dataset.validate_file with the model's tokenizer).

At job creation both files are checked with the job's model and data options (``max_seq_length``,
``truncation``, ``system_message``) and the server's bounds of one example (messages, characters,
tokens): a template that refuses an example, a tool list the template cannot render, an over-long
example under ``truncation: "error"`` or one over a bound is a 400 naming the file's parameter and the
lines, before anything is written. At upload the same check runs when the upload names a ``model``
(form field), and its counts (truncated, dropped, with line numbers) come back in the file object's
``validation``.

A check runs in a check process (api.jobs.check_pool: off the event loop and the database threads,
bounded, within ``ZENFLOW_DATA_CHECK_TIMEOUT_SECONDS``, stopped when the client goes). Its outcome is
kept on the file's row (``files.data_checks``), keyed by :func:`check_key` (the model's identity: its
name and the size and mtime of its folder's files but the weights; the data options; the bounds; the
file's digest and size): an upload checked with a model, or a file an earlier job checked, is not
tokenized again by a create with the same model and options.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from fastapi import Request
from sqlalchemy.orm import Session

from api.core.deps import run_db
from api.core.errors import APIError
from api.jobs.check_pool import CheckCancelled, CheckPool, CheckTimeout
from api.jobs.check_worker import MAX_REPORTED_ERRORS, CheckRequest
from api.jobs.checks import public_errors
from api.jobs.grader_check import missing_item_fields
from contract.hyperparameters import HyperparametersRequest
from contract.method import MethodName
from store.orm import File
from store.settings import Settings
from trainer.data.dataset import METHOD_FORMATS, DataOptions, DatasetReport, ExampleLimits
from trainer.data.jsonl import error_summary
from trainer.resolve import Counts, completion_budget
from trainer.spec import JobSpec

log = logging.getLogger(__name__)

#: Part of every key: raise it when the same inputs may check differently (the kept outcomes expire).
CHECK_VERSION = 3
#: Outcomes kept per file (the oldest goes first).
MAX_KEPT = 8
#: The upload's own check (no tokenizer: the records' format and count), kept beside the outcomes by key
#: and never dropped: the file object's ``format`` (:func:`file_format`).
UPLOAD_KEY = "upload"
#: Files of a model folder that do not change what its tokenizer makes of text.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


@dataclass(frozen=True)
class FileCheck:
    """One file to check with one model: where it is, its key, and its kept outcome for that key."""

    param: str
    #: None at upload (the row does not exist yet).
    file_id: str | None
    path: str
    key: str
    request: CheckRequest
    kept: dict[str, Any] | None = None


def example_limits(settings: Settings) -> ExampleLimits:
    """The server's bounds of one example (``ZENFLOW_MAX_EXAMPLE_*``; trainer.limits)."""
    return ExampleLimits(
        settings.max_example_messages, settings.max_example_chars, settings.max_example_tokens
    )


def data_max_length(model: str, hyperparameters: HyperparametersRequest) -> int:
    """The max_seq_length examples are cut at (as the job's resolution has it: no example count changes it)."""
    from trainer.resolve import max_seq_length

    return max_seq_length(model, hyperparameters)


def model_identity(model: str) -> str:
    """A built-in model's name; a folder's path with the size and mtime of each file but the weights."""
    folder = Path(model)
    if not folder.is_dir():
        return model
    parts = [str(folder.resolve())]
    for f in sorted(folder.iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES):
            st = f.stat()
            parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts)


def check_key(request: CheckRequest, sha256: str, size: int) -> str:
    """What a kept outcome is valid for (see the module docstring)."""
    parts = {
        "version": CHECK_VERSION,
        "model": model_identity(request.model),
        "max_seq_length": request.max_seq_length,
        "options": asdict(request.options),
        "limits": asdict(request.limits),
        "file": [sha256, size],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def plan_check(
    param: str,
    row: File | None,
    path: Path,
    model: str,
    hyperparameters: HyperparametersRequest,
    settings: Settings,
    *,
    sha256: str,
    size: int,
    method: MethodName | None = None,
    completion_tokens: int = 0,
) -> FileCheck:
    """The check of one file (a stored ``row``, or an upload not stored yet) with its kept outcome, for a
    job of ``method`` (None: an upload's, whose records may be any method's). Reads the model's folder:
    call it off the event loop."""
    options = DataOptions(
        hyperparameters.truncation, hyperparameters.system_message, method, completion_tokens
    )
    request = CheckRequest(
        path=str(path),
        model=model,
        max_seq_length=data_max_length(model, hyperparameters) - completion_tokens,
        options=options,
        limits=example_limits(settings),
        budget_seconds=settings.data_check_timeout_seconds,
    )
    key = check_key(request, sha256, size)
    kept = _kept_for(row, request, key, sha256, size) if row is not None else None
    return FileCheck(param, row.id if row is not None else None, str(path), key, request, kept)


def _kept_for(row: File, request: CheckRequest, key: str, sha256: str, size: int) -> dict[str, Any] | None:
    """The outcome kept for ``key``; else a pass of an upload's check (any method's records) whose file
    holds the job's method's kind of records: the same tokenization."""
    kept = row.data_checks or {}
    if key in kept or request.options.method is None:
        return kept.get(key)
    anyone = kept.get(
        check_key(replace(request, options=replace(request.options, method=None)), sha256, size)
    )
    if anyone is None or not anyone.get("ok"):
        return None
    fmt = anyone.get("report", {}).get("format")
    return anyone if fmt in METHOD_FORMATS[request.options.method] else None


def plan_job_checks(
    spec: JobSpec, training: File, validation: File | None, settings: Settings
) -> list[FileCheck]:
    """The checks of a job's training and validation files (see :func:`plan_check`)."""
    files = [("training_file", training), ("validation_file", validation)]
    return [
        plan_check(
            param,
            row,
            Path(row.storage_path),
            spec.model,
            spec.hyperparameters,
            settings,
            sha256=row.sha256,
            size=row.bytes,
            method=spec.method.type,
            completion_tokens=completion_budget(spec),  # a reinforcement prompt leaves room for it
        )
        for param, row in files
        if row is not None
    ]


def remember(session: Session, file_id: str, key: str, outcome: dict[str, Any]) -> None:
    """Keep ``outcome`` on the file's row under ``key`` (at most MAX_KEPT, the oldest dropped)."""
    row = session.get(File, file_id, with_for_update=True)
    if row is None:
        return
    kept = {k: v for k, v in (row.data_checks or {}).items() if k not in (key, UPLOAD_KEY)}
    kept[key] = outcome
    upload = (row.data_checks or {}).get(UPLOAD_KEY)
    row.data_checks = {**({UPLOAD_KEY: upload} if upload else {}), **dict(list(kept.items())[-MAX_KEPT:])}
    session.commit()


def upload_check(report: DatasetReport) -> dict[str, Any]:
    """What is kept of an upload's own check (under UPLOAD_KEY): its records' format and count."""
    return {"ok": True, "report": {"format": report.format, "num_examples": report.num_examples}}


def file_format(data_checks: dict[str, Any] | None) -> str | None:
    """A file's records' format (chat, prompt_completion, preference, reinforcement) as its kept checks
    report it; None for a file uploaded before the format was kept and never checked since."""
    kept = data_checks or {}
    for outcome in (kept.get(UPLOAD_KEY), *kept.values()):
        fmt = (outcome or {}).get("report", {}).get("format") if (outcome or {}).get("ok") else None
        if fmt:
            return str(fmt)
    return None


def kept_outcome(outcome: dict[str, Any]) -> dict[str, Any] | None:
    """What is kept of a check process's outcome: passes and line errors (not a model that cannot be
    loaded, which an operator may fix)."""
    if outcome["outcome"] == "ok":  # the path is the file's place at the time: not kept
        return {"ok": True, "report": {k: v for k, v in outcome["report"].items() if k != "path"}}
    if outcome["outcome"] == "invalid":
        return {"ok": False, "errors": outcome["errors"]}
    return None


async def run_check(
    request: Request, team_id: str, check: FileCheck, *, deadline: float, model_name: str, advice: str
) -> dict[str, Any]:
    """The check's kept form (``{"ok": ...}``): its kept outcome, else a check process's. A model whose
    tokenizer cannot be loaded is a 400 on ``model``; a check past ``deadline`` (the loop's clock) a 400
    ``data_check_timeout`` ending with ``advice``; the client gone a 499, the server stopping a 503."""
    if check.kept is not None:
        return check.kept
    pool: CheckPool = request.app.state.data_checks
    try:
        outcome = await pool.run(
            check.request, team=team_id, deadline=deadline, disconnected=request.is_disconnected
        )
    except CheckTimeout as exc:
        limit = request.app.state.settings.data_check_timeout_seconds
        raise APIError(
            400,
            f"Checking {check.param} with model {model_name!r} did not finish within this server's "
            f"limit of {limit:g} seconds (ZENFLOW_DATA_CHECK_TIMEOUT_SECONDS): {advice}",
            param=check.param,
            code="data_check_timeout",
        ) from exc
    except CheckCancelled as exc:
        raise _cancelled(exc.why) from exc
    except BrokenProcessPool as exc:
        log.error("a data check process died while checking %s", check.path)
        raise APIError(
            503,
            "The data check failed (its process ended); retry shortly",
            code="data_check_unavailable",
            headers={"Retry-After": "2"},
        ) from exc
    if outcome["outcome"] == "model_error":
        raise APIError(
            400,
            f"Model {model_name!r}: its tokenizer cannot be loaded ({outcome['message']})",
            param="model",
            code="invalid_model",
        )
    kept = kept_outcome(outcome)
    assert kept is not None
    if check.file_id is not None:
        await run_db(request, remember, check.file_id, check.key, kept)
    return kept


def _cancelled(why: str) -> APIError:
    if why == "shutdown":
        return APIError(
            503,
            "The server is shutting down; nothing was created. Retry shortly",
            code="server_shutting_down",
            headers={"Retry-After": "2"},
        )
    return APIError(499, "The client closed the request; nothing was created", code="client_closed_request")


def invalid(param: str, model_name: str, errors: list[dict[str, Any]], *, code: str) -> APIError:
    """A 400 ``code`` naming the lines (the message shows the first five)."""
    shown = error_summary(errors)
    first_field = next((e["field"] for e in errors if e.get("field")), None)
    return APIError(
        400,
        f"Invalid {param} for model {model_name!r}: {shown}",
        param=param,
        code=code,
        extra={"field": first_field, "errors": public_errors(errors[:MAX_REPORTED_ERRORS])},
    )


async def check_job_data(
    request: Request,
    team_id: str,
    model_name: str,
    checks: list[FileCheck],
    *,
    item_fields: dict[str, str] | None = None,
) -> Counts | None:
    """Check the job's files (see the module docstring), the kept outcomes reused; a 400
    ``invalid_training_file`` / ``invalid_validation_file`` naming the lines. Then, should the client
    have gone meanwhile, a 499: no job is created for a request nobody waits for. The training file's
    counts as checked (examples after drops, tokens), for the job's resolution."""
    deadline = asyncio.get_running_loop().time() + request.app.state.settings.data_check_timeout_seconds
    advice = (
        "upload it with `model` and the job's data options to have it checked once, before jobs "
        "use it, or split it into smaller files"
    )
    done: dict[str, dict[str, Any]] = {}  # by key: a validation file that is the training file
    counts = None
    for check in checks:
        outcome = done.get(check.key) or await run_check(
            request, team_id, check, deadline=deadline, model_name=model_name, advice=advice
        )
        done[check.key] = outcome
        if not outcome["ok"]:
            raise invalid(check.param, model_name, outcome["errors"], code=f"invalid_{check.param}")
        have = (outcome.get("report") or {}).get("fields")
        if item_fields and (missing := missing_item_fields(item_fields, have, check.param)) is not None:
            raise missing
        if check.param == "training_file":
            report = outcome.get("report") or {}
            counts = Counts(int(report.get("num_examples") or 1), report.get("num_tokens"))
    if await request.is_disconnected():
        raise _cancelled("disconnected")
    return counts


async def check_upload(
    request: Request, team_id: str, check: FileCheck, model_id: str, model_name: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """An upload checked with a model: its ``validation`` object and what its row keeps
    (``data_checks``); a 400 ``invalid_file_format`` naming the lines."""
    deadline = asyncio.get_running_loop().time() + request.app.state.settings.data_check_timeout_seconds
    outcome = await run_check(
        request,
        team_id,
        check,
        deadline=deadline,
        model_name=model_name,
        advice="split it into smaller files",
    )
    if not outcome["ok"]:
        raise invalid("file", model_name, outcome["errors"], code="invalid_file_format")
    return upload_summary(outcome["report"], model_id), {check.key: outcome}


def upload_summary(report: dict[str, Any], model_id: str) -> dict[str, Any]:
    """The ``validation`` object of an upload that named a model."""
    d = {k: v for k, v in report.items() if k != "path"}
    return {"model": model_id, **d, "summary": DatasetReport("", **d).cut_summary() or None}

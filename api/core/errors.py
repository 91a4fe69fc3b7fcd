"""The OpenAI error envelope ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Validation errors become 400 with ``param`` naming the field path (e.g. ``hyperparameters.n_epochs``),
a database that cannot be reached becomes 503 (the next request recovers once it is back), and no bad
input ever surfaces as a 500.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from contract.graders import field_path
from serving.errors import ServingError

log = logging.getLogger(__name__)


# Pieces pydantic adds to ``loc`` for union members and wrapped validators; not field names.
_TAG = re.compile(
    r"^(int|float|str|bool|none|bytes|dict\[.*|list\[.*|tuple\[.*|literal\[.*|function-.*|.*\[.*\]|json-or-python\[.*)$"
)


def error_response(err: ServingError) -> JSONResponse:
    """``err`` as the HTTP answer: its status, envelope and headers."""
    headers = dict(err.headers)
    # The openai SDK retries 409 ("lock timeout") unless told otherwise; ours are final.
    if err.status_code == 409:
        headers.setdefault("x-should-retry", "false")
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers)


class APIError(ServingError):
    """An error answered in the OpenAI shape; raise it anywhere in a request."""

    def response(self) -> JSONResponse:
        return error_response(self)


#: What each documented error status means (the OpenAPI ``responses`` of the routes).
ERROR_DESCRIPTIONS = {
    400: "Invalid request: a parameter, header or the body failed validation (`param` names the field)",
    401: "No API key, or a malformed, unknown or revoked one (`invalid_api_key`)",
    403: "The operation is not allowed on this object (`model_not_deletable`: a base model of the service)",
    404: "No such object for the calling team (`not_found`; another team's id answers the same)",
    409: "Conflicts with the current state (`idempotency_key_reused`, `job_not_cancellable`, `job_not_pausable`, `job_not_paused`, `file_in_use`, `job_not_finished`)",
    413: "The upload is over `max_upload_bytes` (`file_too_large`), or another body over `max_body_bytes` (`request_too_large`)",
    415: "The upload is not multipart/form-data (`invalid_multipart`)",
    429: "A quota of the team is used up (`quota_exceeded`; `param` names it), or every inference slot is taken (`rate_limit_exceeded`); retry after `Retry-After` seconds when given",
    502: "The inference server (vLLM) failed (`inference_backend_error`)",
    503: "The database, the job queue or the inference server is unavailable, or a model cannot be loaded; retry after `Retry-After` seconds when given",
    504: "The request did not finish within the server's time limit (`timeout`); its generation was stopped",
    507: "The server has no storage left to keep the upload (`insufficient_storage`); nothing was kept",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these statuses, each with the error envelope as its body."""
    from api.schemas import ErrorResponse

    return {code: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[code]} for code in codes}


def not_found(kind: str, obj_id: str, param: str = "id") -> APIError:
    return APIError(404, f"No such {kind}: {obj_id}", param=param, code="not_found")


def loc_to_param(loc: Sequence[int | str], *, prefix: str | None = None) -> str | None:
    """``("body", "hyperparameters", "n_epochs")`` -> ``"hyperparameters.n_epochs"``."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header", "form", "cookie"):
        parts = parts[1:]
    parts = list(field_path(parts))  # a grader's type tags (contract.graders): ``grader.graders.a.name``
    out = ""
    for i, p in enumerate(parts):
        if isinstance(p, int):
            out += f"[{p}]"
        elif _TAG.match(p) or (i + 1 < len(parts) and parts[i + 1] == p):
            # the second: a discriminated union's tag before its same-named field (OpenAI's
            # ``{"type": "wandb", "wandb": {...}}``): ``integrations[0].wandb.project``
            continue
        else:
            out = f"{out}.{p}" if out else p
    if prefix:
        out = f"{prefix}.{out}" if out else prefix
    return out or None


def _clean_msg(msg: str) -> str:
    for lead in ("Value error, ", "Assertion failed, "):
        if msg.startswith(lead):
            return msg[len(lead) :]
    return msg


def _unrecognized(param: str | None) -> str:
    """An unknown field's message; one under ``engine`` lists the settings a job may give there."""
    if param is None or not param.startswith("engine."):
        return "unrecognized parameter"
    from contract.engine import EngineRequest

    return (
        "not an engine setting a job may give (the job's engine settings: "
        f"{', '.join(EngineRequest.model_fields)}); the engine's tuning is each worker's (ZENFLOW_ENGINE_TUNING)"
    )


def validation_error(
    errors: Iterable[Mapping[str, Any]], *, prefix: str | None = None, fields: Iterable[str] = ()
) -> APIError:
    """One 400 from pydantic errors: ``param`` is the first failing field, the message lists all."""
    errors = list(errors)
    known = set(fields)
    seen: list[tuple[str | None, str]] = []
    for e in errors:
        msg = _clean_msg(str(e.get("msg", "invalid value")))
        param = loc_to_param(e.get("loc", ()), prefix=prefix)
        # A model-level check that names its field ("select_interval: must be ...") points at it.
        m = re.match(r"^(\w+): (.*)$", msg)
        if m and m.group(1) in known and (param or "").rsplit(".", 1)[-1] != m.group(1):
            param = f"{param}.{m.group(1)}" if param else m.group(1)
            msg = m.group(2)
        if e.get("type") == "missing":
            msg = "required parameter is missing"
        elif e.get("type") == "extra_forbidden":
            msg = _unrecognized(param)
        if (param, msg) not in seen:
            seen.append((param, msg))
    if not seen:
        return APIError(400, "Invalid request")
    param = seen[0][0]
    message = "; ".join(f"{p}: {m}" if p else m for p, m in seen)
    code = "missing_required_parameter" if errors[0].get("type") == "missing" else "invalid_value"
    return APIError(400, f"Invalid request: {message}", param=param, code=code)


#: Validation errors of a body that is not a JSON object at all.
_NOT_AN_OBJECT = frozenset({"model_attributes_type", "dict_type", "model_type"})


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def body_type_error(errors: Sequence[Mapping[str, Any]], content_type: str | None) -> APIError | None:
    """The 400 for a body that failed as a whole (not a field of it): with no JSON Content-Type the
    body was never parsed as JSON, so say that, not "Input should be a valid dictionary"."""
    if not any(tuple(e.get("loc", ())) == ("body",) and e.get("type") in _NOT_AN_OBJECT for e in errors):
        return None
    if not _is_json(content_type):
        got = f"got {content_type!r}" if content_type else "no Content-Type header was sent"
        return APIError(
            400,
            f"Send the request body as JSON with 'Content-Type: application/json' ({got})",
            param="Content-Type",
            code="invalid_content_type",
        )
    return APIError(400, "The request body must be a JSON object", code="invalid_value")


_METHODS = ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT")


def allowed_methods(scope: Scope) -> list[str]:
    """Every method some route of the app serves at ``scope``'s path, sorted (each method is tried
    against the routes, so routers included with their own matching are asked too)."""
    router = scope.get("router") or getattr(scope.get("app"), "router", None)
    routes = list(getattr(router, "routes", ()))
    return [
        m for m in _METHODS if any(route.matches({**scope, "method": m})[0] == Match.FULL for route in routes)
    ]


def _db_unavailable(exc: Exception) -> bool:
    if isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError | sa_exc.DisconnectionError):
        return True
    if isinstance(exc, sa_exc.TimeoutError):  # pool exhausted
        return True
    return isinstance(exc, sa_exc.DBAPIError) and bool(exc.connection_invalidated)


async def _api_error(_request: Request, exc: ServingError) -> JSONResponse:
    return error_response(exc)


async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    # A body that is not JSON at all.
    if any(e.get("type") == "json_invalid" for e in errors):
        return APIError(400, "Request body is not valid JSON", code="invalid_json").response()
    wrong_body = body_type_error(errors, request.headers.get("content-type"))
    if wrong_body is not None:
        return wrong_body.response()
    return validation_error(errors).response()


async def _pydantic_validation(_request: Request, exc: ValidationError) -> JSONResponse:
    return validation_error(list(exc.errors())).response()


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else "Request failed"
    if exc.status_code == 404 and message == "Not Found":
        message = "Unknown request URL"
    err = APIError(exc.status_code, message, code=getattr(exc, "error_code", None))
    err.headers.update(exc.headers or {})
    if exc.status_code == 405:
        # Starlette names the methods of the first route that matched the path; a path served by
        # several routes (GET and DELETE /v1/files/{id}) has them all.
        methods = allowed_methods(request.scope)
        if methods:
            err.headers["Allow"] = ", ".join(methods)
            err.message = f"Method {request.method} is not allowed here; use {', '.join(methods)}"
    return err.response()


async def _db_error(_request: Request, exc: sa_exc.SQLAlchemyError) -> JSONResponse:
    if _db_unavailable(exc):
        log.warning("database unavailable: %s", exc.__class__.__name__)
        return APIError(
            503,
            "The database is unavailable; retry shortly",
            code="database_unavailable",
            headers={"Retry-After": "1"},
        ).response()
    if isinstance(exc, sa_exc.IntegrityError):
        return APIError(409, "The request conflicts with the current state", code="conflict").response()
    if isinstance(exc, sa_exc.DataError):  # a value the database cannot hold (out of range, NUL byte)
        log.warning("database refused a value: %s", exc.orig)
        return APIError(
            400, "A value in the request is out of range for this server", code="invalid_value"
        ).response()
    log.exception("database error")
    return APIError(500, "Internal server error", code="internal_error").response()


async def _unhandled(_request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return APIError(500, "Internal server error", code="internal_error").response()


#: Each failure's handler, in the order they are registered.
_HANDLERS: tuple[tuple[type[Exception], Callable[[Request, Any], Awaitable[JSONResponse]]], ...] = (
    (ServingError, _api_error),
    (RequestValidationError, _request_validation),
    (ValidationError, _pydantic_validation),
    (StarletteHTTPException, _http_error),
    (sa_exc.SQLAlchemyError, _db_error),
    (Exception, _unhandled),
)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that turn every failure into the OpenAI error envelope."""
    for exc_class, handler in _HANDLERS:
        app.add_exception_handler(exc_class, handler)

"""The serving process (``python -m serving``): the engine (``serving.local``) behind HTTP, for the API
to reach when serving is deployed apart (``inference_server_url``), scaled on its own.

It is internal: it answers only requests bearing ``inference_server_token``, and trusts the team and the
model folder the API resolved (the API checks the key and the team's access to the model). Its routes
take ``{"team", "model", "request"}`` and answer as the public endpoints would: the completion, its
stream, or the OpenAI error envelope with its status and ``Retry-After``. ``/healthz``, ``/readyz`` and
``/metrics`` (the ``zenflow_inference_*`` families, ``serving.prometheus``) are open, as the API's are.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from contract.serving import INTERNAL_PATHS
from serving.client import Call, Reply, ServedModel
from serving.config import ServingSettings, server_token
from serving.errors import ServingError
from serving.local import LocalEngine
from serving.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)


class ChatCall(BaseModel):
    team: str
    model: ServedModel
    request: ChatCompletionRequest


class CompletionCall(BaseModel):
    team: str
    model: ServedModel
    request: CompletionRequest


def _param(loc: tuple[int | str, ...]) -> str | None:
    """A validation error's field in the client's body (the call's ``request`` stripped off)."""
    parts = [str(p) for p in loc if p not in ("body",)]
    if parts[:1] == ["request"]:
        parts = parts[1:]
    return ".".join(parts) or None


router = APIRouter()


def _authorized(request: Request, authorization: str | None) -> LocalEngine:
    """The app's engine, for a request bearing the token; 401 otherwise."""
    given = (authorization or "").removeprefix("Bearer ").encode()
    if not hmac.compare_digest(given, request.app.state.token.encode()):
        raise ServingError(
            401, "This is the serving process: only the API may call it", code="invalid_api_key"
        )
    engine: LocalEngine = request.app.state.engine
    return engine


@router.post(INTERNAL_PATHS["chat"], response_model=None)
async def chat(
    call: ChatCall, request: Request, authorization: Annotated[str | None, Header()] = None
) -> Reply:
    engine = _authorized(request, authorization)
    return await engine.generate(Call(call.request, call.model, call.team, request.is_disconnected))


@router.post(INTERNAL_PATHS["completions"], response_model=None)
async def completions(
    call: CompletionCall, request: Request, authorization: Annotated[str | None, Header()] = None
) -> Reply:
    engine = _authorized(request, authorization)
    return await engine.generate(Call(call.request, call.model, call.team, request.is_disconnected))


@router.get("/healthz")
async def healthz() -> dict[str, Any]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> dict[str, Any]:
    return {"status": "ready", "backend": request.app.state.engine.settings.inference_backend}


@router.get("/metrics")
async def metrics() -> PlainTextResponse:
    return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)


async def _error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServingError)
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


async def _invalid(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    err = ServingError(
        400, f"Invalid request: {first.get('msg', 'invalid body')}", param=_param(tuple(first.get("loc", ())))
    )
    return JSONResponse(err.body(), status_code=400)


def create_app(settings: ServingSettings) -> FastAPI:
    token = server_token(settings)
    engine = LocalEngine(settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await engine.aclose()

    app = FastAPI(title="ZenFlow serving", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.token = engine, token
    app.add_exception_handler(ServingError, _error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.include_router(router)
    return app

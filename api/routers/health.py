"""Liveness (``/healthz``: the process answers) and readiness (``/readyz``: database and broker)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from api.schemas import Readiness

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


def _check_database(request: Request) -> str:
    with request.app.state.engine.connect() as conn:
        conn.execute(text("SELECT 1"))
    return "ok"


def _check_broker(request: Request) -> str:
    from kombu.connection import Connection

    settings = request.app.state.settings
    timeout = request.app.state.api_settings.readiness_timeout_seconds
    with Connection(
        settings.resolved_broker_url, connect_timeout=timeout, transport_options={"socket_timeout": timeout}
    ) as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=timeout)
    return "ok"


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "The database or the broker is unavailable"}},
)
async def readyz(request: Request) -> JSONResponse:
    checks: dict[str, Any] = {}
    ok = True
    for name, fn in (("database", _check_database), ("broker", _check_broker)):
        t0 = time.perf_counter()
        try:
            await run_in_threadpool(fn, request)
            checks[name] = {"status": "ok", "seconds": round(time.perf_counter() - t0, 4)}
        except Exception as exc:
            ok = False
            checks[name] = {"status": "unavailable", "error": f"{exc.__class__.__name__}: {str(exc)[:200]}"}
    return JSONResponse(
        {"status": "ok" if ok else "unavailable", "checks": checks}, status_code=200 if ok else 503
    )

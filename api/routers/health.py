"""Liveness (``/healthz``: the process answers) and readiness (``/readyz``: database and broker)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text

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


async def _probe(fn: Callable[[Request], str], request: Request, timeout: float) -> dict[str, Any]:
    """One check in a thread, answered within ``timeout`` (a check that hangs is left to finish on
    its own bound in its thread; the probe does not wait for it)."""
    t0 = time.perf_counter()
    try:
        with anyio.fail_after(timeout):
            await anyio.to_thread.run_sync(fn, request, abandon_on_cancel=True)
    except TimeoutError:
        return {"status": "unavailable", "error": f"no answer within {timeout:g} s"}
    except Exception as exc:
        return {"status": "unavailable", "error": f"{exc.__class__.__name__}: {str(exc)[:200]}"}
    return {"status": "ok", "seconds": round(time.perf_counter() - t0, 4)}


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "The database or the broker is unavailable"}},
)
async def readyz(request: Request) -> JSONResponse:
    """Both checks at once, each answered within ``readiness_timeout_seconds``."""
    timeout = request.app.state.api_settings.readiness_timeout_seconds
    checks: dict[str, Any] = {}

    async def probe(name: str, fn: Callable[[Request], str]) -> None:
        checks[name] = await _probe(fn, request, timeout)

    probes = {"database": _check_database, "broker": _check_broker}
    async with anyio.create_task_group() as tg:
        for name, fn in probes.items():
            tg.start_soon(probe, name, fn)
    ok = all(c["status"] == "ok" for c in checks.values())
    return JSONResponse(
        {"status": "ok" if ok else "unavailable", "checks": {name: checks[name] for name in probes}},
        status_code=200 if ok else 503,
    )

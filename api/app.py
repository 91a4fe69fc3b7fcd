"""The FastAPI application factory."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlalchemy.orm import sessionmaker
from starlette.concurrency import run_in_threadpool

from api import integration
from api.config import ApiSettings, get_api_settings
from api.errors import install_error_handlers
from api.routers import files, health, jobs
from store.db import make_engine
from store.settings import Settings, get_settings

log = logging.getLogger(__name__)

Enqueue = Callable[[str, str], None]


def create_app(
    settings: Settings | None = None,
    api_settings: ApiSettings | None = None,
    *,
    enqueue: Enqueue | None = None,
) -> FastAPI:
    """Build the app. ``enqueue(job_id, queue)`` defaults to trainer.worker.enqueue_job."""
    settings = settings or get_settings()
    api_settings = api_settings or get_api_settings()
    url = settings.resolved_database_url

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if api_settings.migrate_on_start:
            from api.migrate import upgrade_with_retry

            await run_in_threadpool(upgrade_with_retry, url)
        settings.resolved_files_dir.mkdir(parents=True, exist_ok=True)
        yield
        app.state.engine.dispose()

    app = FastAPI(
        title="ZenFlow fine-tuning API",
        version="0.1.0",
        description="OpenAI-compatible files and fine-tuning jobs, run on the ZenFlow offload engine.",
        lifespan=lifespan,
    )
    engine = make_engine(url)
    app.state.settings = settings
    app.state.api_settings = api_settings
    app.state.engine = engine
    app.state.sessionmaker = sessionmaker(bind=engine, expire_on_commit=False)
    app.state.enqueue = enqueue or integration.enqueue

    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(files.router)
    app.include_router(jobs.router)
    _install_metrics(app)
    return app


def _install_metrics(app: FastAPI) -> None:
    """Prometheus /metrics from api.metrics (deploy's module) when it is present."""
    if importlib.util.find_spec("api.metrics") is None:
        return
    from api.metrics import install_metrics  # type: ignore[import-not-found]

    install_metrics(app)

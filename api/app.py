"""The FastAPI application factory."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import Depends, FastAPI
from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker
from starlette.concurrency import run_in_threadpool

from api.builtin_cache import BUILTIN_DIR, BuiltinCache
from api.console import install_console
from api.core.auth import KeyCache
from api.core.body_limit import BodyLimitMiddleware
from api.core.config import ApiSettings, get_api_settings
from api.core.errors import install_error_handlers
from api.core.guards import HeaderLimitMiddleware, no_nul_in_ids
from api.core.prometheus import install_metrics
from api.docs_pages import install_docs
from api.jobs import checks
from api.jobs.check_pool import CheckPool
from api.routers import chat, events, files, graders, health, jobs, models, quotas
from api.storage import LocalFileStore
from serving.client import EngineClient
from serving.local import LocalEngine
from serving.remote import RemoteEngine
from store.db import make_engine
from store.settings import Settings, get_settings

if TYPE_CHECKING:
    from worker.broker import Enqueue

log = logging.getLogger(__name__)


def create_app(
    settings: Settings | None = None,
    api_settings: ApiSettings | None = None,
    *,
    enqueue: Enqueue | None = None,
) -> FastAPI:
    """Build the app. ``enqueue(job_id, queue)`` defaults to worker.broker.enqueue_job."""
    settings = settings or get_settings()
    api_settings = api_settings or get_api_settings()
    url = settings.resolved_database_url
    app = FastAPI(
        title="ZenFlow fine-tuning API",
        version="0.1.0",
        description="OpenAI-compatible files and fine-tuning jobs, run on the ZenFlow offload engine.",
        lifespan=_lifespan(settings, api_settings, url, with_broker=enqueue is None),
        # FastAPI's pages load their scripts from a CDN; ours are vendored, under a CSP (api.docs_pages)
        docs_url=None,
        redoc_url=None,
        swagger_ui_oauth2_redirect_url=None,
    )
    _set_state(app, settings, api_settings, url, enqueue)
    install_error_handlers(app)
    _include_routers(app)
    install_console(app)  # the static self-serve console at /console (api/console.py)
    install_docs(app)  # Swagger UI at /docs, vendored (api/docs_pages.py)
    app.add_middleware(BodyLimitMiddleware, max_bytes=api_settings.max_body_bytes)
    _install_metrics(app)
    app.add_middleware(
        HeaderLimitMiddleware,
        max_count=api_settings.max_header_count,
        max_bytes=api_settings.max_header_bytes,
    )
    _install_openapi(app)
    return app


def _lifespan(
    settings: Settings, api_settings: ApiSettings, url: str, *, with_broker: bool
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's start (migrations, stale uploads swept, the ML stack imported, the data checks'
    pool, the heap frozen, the retention loop) and its end (each stopped, the database pool closed)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await _start(app, settings, api_settings, url, with_broker=with_broker)
        retention = (
            asyncio.create_task(_retention_loop(app)) if api_settings.retention_interval_seconds else None
        )
        try:
            yield
        finally:
            if retention is not None:
                retention.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await retention
            await app.state.inference.aclose()
            app.state.data_checks.close()  # running data checks stop at their next line
            app.state.engine.dispose()

    return lifespan


async def _start(
    app: FastAPI, settings: Settings, api_settings: ApiSettings, url: str, *, with_broker: bool
) -> None:
    if api_settings.migrate_on_start:
        from api.migrate import upgrade_with_retry

        await run_in_threadpool(upgrade_with_retry, url)
    settings.resolved_files_dir.mkdir(parents=True, exist_ok=True)
    swept = await run_in_threadpool(
        LocalFileStore(settings.resolved_files_dir).sweep_incoming, api_settings.stale_upload_seconds
    )
    if swept:
        log.info("removed %d upload temp file(s) left by an earlier API process", len(swept))
    await run_in_threadpool(app.state.builtin_cache.sweep_partial, api_settings.stale_upload_seconds)
    await run_in_threadpool(_import_ml_stack)  # before the first request (see _CREATE_PATH_MODULES)
    app.state.data_checks.open()
    app.state.data_checks.hook_signals()  # SIGTERM stops running data checks (api.jobs.check_pool)
    if api_settings.gc_freeze:
        freeze_startup_heap(with_broker=with_broker)


def _set_state(
    app: FastAPI, settings: Settings, api_settings: ApiSettings, url: str, enqueue: Enqueue | None
) -> None:
    """What the routes share: settings, the database, the enqueue, the key cache, the limiter, the
    inference service and the data checks' pool (processes and models start on first use)."""
    engine = make_engine(url)
    app.state.settings = settings
    app.state.api_settings = api_settings
    app.state.engine = engine
    app.state.sessionmaker = sessionmaker(bind=engine, expire_on_commit=False)
    app.state.enqueue = enqueue or checks.enqueue
    app.state.key_cache = KeyCache(api_settings.key_cache_seconds)
    app.state.db_limiter = anyio.CapacityLimiter(api_settings.db_threads or _pool_size(engine))
    app.state.inference = engine_client(api_settings)
    app.state.data_checks = CheckPool(settings.data_check_workers)  # processes start on first use
    app.state.builtin_cache = BuiltinCache(settings.data_dir / BUILTIN_DIR, api_settings.builtin_cache_bytes)


def engine_client(api_settings: ApiSettings) -> EngineClient:
    """Where chat and completions run: the serving process when one is configured, else this process
    (models load on first use)."""
    if api_settings.inference_server_url:
        return RemoteEngine(
            api_settings.inference_server_url,
            api_settings.inference_server_token.get_secret_value(),
            timeout_seconds=api_settings.inference_timeout_seconds,
        )
    return LocalEngine(api_settings)


def _include_routers(app: FastAPI) -> None:
    app.include_router(health.router)
    # Authenticated routers: an id with a NUL byte answers 404 on every database (api.core.guards).
    ids_checked = [Depends(no_nul_in_ids)]
    app.include_router(files.router, dependencies=ids_checked)
    # events ahead of the other /v1/fine_tuning/jobs routes: none can shadow it
    app.include_router(events.router, dependencies=ids_checked)
    app.include_router(jobs.router, dependencies=ids_checked)
    app.include_router(models.router, dependencies=ids_checked)
    app.include_router(quotas.router)
    app.include_router(chat.router)
    app.include_router(graders.router)


#: What requests use (upload validation, create's checks), imported before the heap is frozen; with
#: ``with_broker`` also the default enqueue's ``worker.broker``, which loads on first use.
_REQUEST_PATH_MODULES = ("trainer.data.dataset", "trainer.model.catalog", "trainer.spec", "offload.config")


#: What job create (the plan, the model and data checks) and inference import on first use: torch
#: and transformers take seconds, and transformers' lazy module is not safe to import from two
#: threads at once (a create and a chat request racing on first use saw "cannot import name
#: PreTrainedTokenizerFast"), so they are imported once, at start, before requests are served.
_CREATE_PATH_MODULES = (
    "torch",
    "trainer.plan.planner",
    "trainer.model.folder_check",
    "trainer.data.chat_format",
)
_TRANSFORMERS_NAMES = (
    "AutoConfig",
    "AutoModelForCausalLM",
    "AutoTokenizer",
    "GenerationConfig",
    "LlamaConfig",
    "LlamaForCausalLM",
    "PreTrainedModel",
    "PreTrainedTokenizerBase",
    "PreTrainedTokenizerFast",
)


def _import_quietly(names: tuple[str, ...]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # an optional part that fails to import fails again, visibly, on its request
            log.debug("could not pre-import %s", name, exc_info=True)


def _import_ml_stack() -> None:
    _import_quietly(_CREATE_PATH_MODULES)
    try:
        import transformers

        for name in _TRANSFORMERS_NAMES:  # resolves each lazy attribute (and its submodule) now
            getattr(transformers, name)
    except Exception:
        log.debug("could not pre-import transformers", exc_info=True)


def freeze_startup_heap(*, with_broker: bool = True) -> None:
    """Keep full collections of the cyclic GC off the request path.

    A generation-2 collection walks every tracked object: with the ~100k the service holds after
    start (modules, classes, SQLAlchemy and pydantic metadata) that is ~100 ms on a small machine, a
    pause every few thousand requests that makes the read latency's p99. So: import what requests
    would import lazily, collect once, and move everything alive to the permanent generation
    (``gc.freeze``); later collections walk only what was allocated since. Process-wide and harmless
    to repeat (a second app in the same process just freezes a little more).
    """
    _import_quietly((*_REQUEST_PATH_MODULES, "worker.broker") if with_broker else _REQUEST_PATH_MODULES)
    gc.collect()
    gc.freeze()


def _install_openapi(app: FastAPI) -> None:
    """The generated schema, less FastAPI's automatic 422 responses: request validation answers 400
    in the error envelope, and every route documents that (and its other errors) itself."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            for item in schema.get("paths", {}).values():
                for op in item.values():
                    if isinstance(op, dict):
                        op.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in (
                "HTTPValidationError",
                "ValidationError",
            ):  # in this order: the first refers to the second
                others = {k: v for k, v in schemas.items() if k != name}
                if f'"#/components/schemas/{name}"' not in json.dumps([schema["paths"], others]):
                    schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def _retention_loop(app: FastAPI) -> None:
    """The retention sweep (api.retention) every ``retention_interval_seconds``, first one interval
    after start; a failed round is logged and the next one tried."""
    from api.retention import sweep

    api_settings: ApiSettings = app.state.api_settings
    settings: Settings = app.state.settings
    while True:
        await asyncio.sleep(api_settings.retention_interval_seconds)
        try:
            await run_in_threadpool(
                sweep,
                app.state.sessionmaker,
                keep=api_settings.retain_checkpoints,
                jobs_dir=settings.resolved_jobs_dir,
            )
        except Exception:
            log.exception("retention sweep failed")


def _pool_size(engine: Engine) -> int:
    size = getattr(engine.pool, "size", None)
    return max(1, size()) if callable(size) else 5


def _install_metrics(app: FastAPI) -> None:
    """Prometheus /metrics (api.core.prometheus)."""
    install_metrics(app)

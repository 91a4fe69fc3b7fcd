"""The API's Prometheus metrics: request latency by route template, and job counts read at scrape time.

``install_metrics(app)`` (called by ``api.app.create_app``) adds:

* a pure-ASGI middleware observing ``http_request_duration_seconds{route, method, status}``; ``route``
  is the matched route's template (``/v1/fine_tuning/jobs/{fine_tuning_job_id}``), never the raw path,
  and ``unmatched`` for requests no route matched, so the label stays bounded; ``method`` is one of
  the standard verbs or ``other``. The duration runs until the response is complete (for the event
  stream that is the stream's life; it has its own route label).
* ``GET /metrics`` (not in the OpenAPI schema, no API key: it exposes only aggregate counts) with
  collectors read at scrape time: :class:`JobsCollector` (the database: ``zenflow_jobs{status}``, every
  status, zeros included; per queue the jobs waiting, the longest wait and the live workers;
  ``zenflow_db_up``; a Redis broker's ``zenflow_broker_up`` and queue lengths) and
  :class:`StorageCollector` (the data volumes' free bytes; the built-in models' download cache
  against its budget).

Multiprocess: when ``PROMETHEUS_MULTIPROC_DIR`` is set before the server starts (uvicorn/gunicorn with
several workers; wipe the directory before each start), the request histogram is written to the
shared directory and ``/metrics`` merges every process's files (prometheus-client's
MultiProcessCollector); the database collector runs once, in whichever process answers the scrape.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from worker.metrics.multiprocess import multiprocess_dir

log = logging.getLogger(__name__)

UNMATCHED = "unmatched"
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# Reads are milliseconds; uploads and creates tens to hundreds; the tail covers a slow database.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_HIST: Histogram | None = None
_HIST_LOCK = threading.Lock()


def request_duration_histogram() -> Histogram:
    """The process-wide histogram (one per process, however many apps are created)."""
    global _HIST
    with _HIST_LOCK:
        if _HIST is None:
            _HIST = Histogram(
                "http_request_duration_seconds",
                "HTTP request duration until the response is complete, by route template.",
                ("route", "method", "status"),
                buckets=LATENCY_BUCKETS,
            )
        return _HIST


def route_template(scope: Scope, root_path_at_entry: str = "") -> str:
    route = scope.get("route")
    if route is None:
        return UNMATCHED
    path: str | None = getattr(route, "path_format", None) or getattr(route, "path", None)
    if not path:
        return UNMATCHED
    # A route inside a mounted app: prefix the mount's path (Starlette grows root_path in place).
    root = scope.get("root_path", "") or ""
    if root.startswith(root_path_at_entry) and len(root) > len(root_path_at_entry):
        path = root[len(root_path_at_entry) :].rstrip("/") + path
    return path


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, histogram: Histogram | None = None) -> None:
        self.app = app
        self.histogram = histogram or request_duration_histogram()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        root_at_entry = scope.get("root_path", "") or ""
        status = 500  # an exception before the response started becomes a 500 outside us

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            method = scope.get("method", "GET")
            self.histogram.labels(
                route_template(scope, root_at_entry), method if method in METHODS else "other", str(status)
            ).observe(time.perf_counter() - start)


@dataclass(frozen=True)
class _JobCounts:
    by_status: dict[str, int]
    #: queue -> jobs waiting, seconds the longest-waiting one has waited since it was (re)dispatched
    queued: dict[str, int]
    oldest_wait: dict[str, float]
    #: queue -> live workers consuming it (the registry's rule: heartbeat within ``worker_live_seconds``)
    workers: dict[str, int]


def _read_jobs(session: Any, settings: Any) -> _JobCounts:
    from sqlalchemy import func, select

    from store import worker_registry
    from store.orm import FineTuningJob, JobStatus, as_utc, utcnow
    from store.settings import get_settings

    now = utcnow()
    by_status = {
        str(status): int(n)
        for status, n in session.execute(
            select(FineTuningJob.status, func.count()).group_by(FineTuningJob.status)
        )
    }
    waiting_since = func.min(func.coalesce(FineTuningJob.dispatched_at, FineTuningJob.created_at))
    queued_rows = session.execute(
        select(FineTuningJob.queue, func.count(), waiting_since)
        .where(FineTuningJob.status == JobStatus.queued.value)
        .group_by(FineTuningJob.queue)
    ).all()
    live = (settings or get_settings()).worker_live_seconds
    workers = worker_registry.live_workers_by_queue(session, live_seconds=live, now=now)
    return _JobCounts(
        by_status=by_status,
        queued={q: int(n) for q, n, _ in queued_rows},
        oldest_wait={q: max(0.0, (now - (as_utc(t) or now)).total_seconds()) for q, _, t in queued_rows},
        workers=workers,
    )


class JobsCollector(Collector):
    """Read at scrape time from the database: ``zenflow_db_up``, ``zenflow_jobs{status}``, and per queue
    ``zenflow_queue_depth``, ``zenflow_queue_oldest_wait_seconds`` and ``zenflow_queue_workers``; from a
    Redis broker ``zenflow_broker_up`` and ``zenflow_broker_queue_messages{queue}``."""

    def __init__(self, session_factory: Callable[[], Any], settings: Callable[[], Any] | None = None) -> None:
        self.session_factory = session_factory
        self.settings = settings
        self._redis: Any = None
        self._redis_url: str | None = None

    def collect(self) -> Iterator[Metric]:
        from store.orm import JobStatus

        settings = self.settings() if self.settings else None
        up = GaugeMetricFamily("zenflow_db_up", "1 when the API could read the database at this scrape.")
        try:
            session = self.session_factory()
            try:
                counts = _read_jobs(session, settings)
            finally:
                session.close()
        except Exception as e:
            log.warning("metrics: database read failed: %s", e)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        jobs = GaugeMetricFamily("zenflow_jobs", "Fine-tuning jobs by status (all teams).", labels=["status"])
        for st in JobStatus:
            jobs.add_metric([st.value], counts.by_status.get(st.value, 0))
        yield jobs
        queues = sorted(
            {getattr(settings, "default_queue", None) or "gpu-default", *counts.queued, *counts.workers}
        )
        yield from _queue_families(counts, queues)
        yield from self._broker(getattr(settings, "resolved_broker_url", None), queues)

    def _broker(self, url: str | None, queues: list[str]) -> Iterator[Metric]:
        if not url or not url.startswith(("redis://", "rediss://")):
            return
        up = GaugeMetricFamily(
            "zenflow_broker_up", "1 when the API could read the Redis broker at this scrape."
        )
        try:
            import redis

            if self._redis is None or self._redis_url != url:
                self._redis = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
                self._redis_url = url
            pipe = self._redis.pipeline(transaction=False)
            for q in queues:
                pipe.llen(q)
            lengths = pipe.execute()
        except Exception as e:
            log.debug("metrics: broker unavailable: %s", e)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        fam = GaugeMetricFamily(
            "zenflow_broker_queue_messages",
            "Messages in the Celery broker's queue list (Redis).",
            labels=["queue"],
        )
        for q, n in zip(queues, lengths, strict=True):
            fam.add_metric([q], int(n))
        yield fam


def _queue_families(counts: _JobCounts, queues: list[str]) -> Iterator[Metric]:
    depth = GaugeMetricFamily(
        "zenflow_queue_depth", "Jobs waiting for a worker (status queued), by queue.", labels=["queue"]
    )
    wait = GaugeMetricFamily(
        "zenflow_queue_oldest_wait_seconds",
        "How long the longest-waiting queued job of a queue has waited since it was (re)queued (0: none).",
        labels=["queue"],
    )
    workers = GaugeMetricFamily(
        "zenflow_queue_workers",
        "Live workers consuming a queue (registry heartbeat within worker_live_seconds).",
        labels=["queue"],
    )
    for q in queues:
        depth.add_metric([q], counts.queued.get(q, 0))
        wait.add_metric([q], counts.oldest_wait.get(q, 0.0))
        workers.add_metric([q], counts.workers.get(q, 0))
    yield from (depth, wait, workers)


class _Proxy(Collector):
    """Collects another registry's metrics (the process-wide one) into a per-app registry."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        yield from self.source.collect()


class StorageCollector(Collector):
    """Read at scrape time: ``zenflow_data_free_bytes{volume}`` and ``zenflow_data_size_bytes{volume}``
    of the file systems holding uploads (``files``) and job outputs (``jobs``), and the built-in models'
    download cache (api.builtin_cache): ``zenflow_builtin_cache_bytes`` against
    ``zenflow_builtin_cache_budget_bytes``."""

    def __init__(self, settings: Callable[[], Any], cache: Callable[[], Any]) -> None:
        self.settings, self.cache = settings, cache

    def collect(self) -> Iterator[Metric]:
        yield from self._volumes()
        cache = self.cache()
        if cache is not None:
            usage = cache.usage()
            yield GaugeMetricFamily(
                "zenflow_builtin_cache_bytes",
                "Bytes of built-in models' weights written for download (data_dir/builtin-models).",
                value=usage.bytes,
            )
            yield GaugeMetricFamily(
                "zenflow_builtin_cache_budget_bytes",
                "The most those weights are kept at (least recently used removed first).",
                value=usage.budget_bytes,
            )

    def _volumes(self) -> Iterator[Metric]:
        settings = self.settings()
        free = GaugeMetricFamily(
            "zenflow_data_free_bytes", "Bytes free to the service on a data volume.", labels=["volume"]
        )
        size = GaugeMetricFamily(
            "zenflow_data_size_bytes", "Size of a data volume in bytes.", labels=["volume"]
        )
        for volume, path in (("files", settings.resolved_files_dir), ("jobs", settings.resolved_jobs_dir)):
            try:
                st = os.statvfs(path)
            except OSError:
                continue  # not made yet
            free.add_metric([volume], st.f_bavail * st.f_frsize)
            size.add_metric([volume], st.f_blocks * st.f_frsize)
        yield from (free, size)


def metrics_registry(jobs: Collector | None, *more: Collector) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    # Only when this process itself writes its samples there (the variable was set before
    # prometheus_client was imported): a variable set later (an embedded worker in this process
    # serving its job runners) must not hide our in-memory request histogram.
    path = multiprocess_dir()
    if path is not None:
        MultiProcessCollector(reg, path=path)
    else:
        reg.register(_Proxy(REGISTRY))
    for collector in (jobs, *more):
        if collector is not None:
            reg.register(collector)
    return reg


def _session_factory_of(app: Any) -> Callable[[], Any]:
    def factory() -> Any:
        sm = getattr(app.state, "sessionmaker", None)
        if sm is None:
            from store.db import session_factory

            sm = session_factory()
        return sm()

    return factory


def _settings_of(app: Any) -> Callable[[], Any]:
    def settings() -> Any:
        s = getattr(app.state, "settings", None)
        if s is None:
            from store.settings import get_settings

            s = get_settings()
        return s

    return settings


def install_metrics(
    app: Any, *, path: str = "/metrics", session_factory: Callable[[], Any] | None = None
) -> None:
    """Add the latency middleware and ``GET /metrics`` to a FastAPI app (call before it starts)."""
    if getattr(app.state, "zenflow_metrics_installed", False):
        return
    app.state.zenflow_metrics_installed = True
    request_duration_histogram()
    app.add_middleware(MetricsMiddleware)
    jobs = JobsCollector(session_factory or _session_factory_of(app), _settings_of(app))
    storage = StorageCollector(_settings_of(app), lambda: getattr(app.state, "builtin_cache", None))
    registry = metrics_registry(jobs, storage)

    def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route(path, metrics, methods=["GET"], include_in_schema=False, name="prometheus_metrics")

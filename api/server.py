"""``zenflow serve``: the API under uvicorn, plus (on embedded defaults) a Celery worker and the
reaper in the same process, so one command runs the whole service on one machine."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from api.console import CONSOLE_PATH
from api.core.config import ApiSettings, get_api_settings
from api.docs_pages import DOCS_PATH
from store.settings import Settings, get_settings

log = logging.getLogger("zenflow.serve")


def uvicorn_options(api_settings: ApiSettings | None = None) -> dict[str, Any]:
    """The uvicorn settings of every way the API is run (``zenflow serve``, :func:`uvicorn_command`).

    The HTTP implementation is h11, not httptools (uvicorn's "auto" choice when installed): h11 stops
    buffering a request head (request line and headers) past ``max_incomplete_event_size``, answering
    400 and closing the connection, while uvicorn's httptools protocol has no bound at all (a 64 MB
    header was read into memory). The cost is h11's pure-Python parsing per request.
    """
    s = api_settings or get_api_settings()
    return {
        "http": "h11",
        "h11_max_incomplete_event_size": s.max_header_bytes,
        "timeout_keep_alive": s.keep_alive_seconds,
    }


def uvicorn_command(port: int, *, host: str = "127.0.0.1", workers: int = 1) -> list[str]:
    """argv that runs the API alone (no worker) under uvicorn, from the app factory, quietly: what the
    load benchmark and the multi-process tests start (with :func:`uvicorn_options`)."""
    opts = uvicorn_options()
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "api.app:create_app",
        "--factory",
        "--host",
        host,
        "--port",
        str(port),
        "--no-access-log",
        "--log-level",
        "warning",
        "--workers",
        str(workers),
        "--http",
        opts["http"],
        "--h11-max-incomplete-event-size",
        str(opts["h11_max_incomplete_event_size"]),
        "--timeout-keep-alive",
        str(opts["timeout_keep_alive"]),
    ]


def start_worker(settings: Settings, *, reaper: bool) -> Callable[[], None]:
    """The in-process Celery worker (solo pool; the default queue, and the queue of
    ``gpus_per_job``-rank jobs when ``cpu_ranks`` lets it run them as CPU ranks), with the reaper
    when asked."""
    from worker.embedded import embedded_queues, start_embedded_worker

    queues = embedded_queues(settings)
    worker = start_embedded_worker(queues=queues, settings=settings, reaper=reaper, loglevel="INFO")
    log.info("embedded worker %s consuming %s", worker.hostname, ", ".join(queues))
    return worker.stop


def start_reaper(settings: Settings) -> Callable[[], None]:
    """The stale-heartbeat reaper alone (an API process beside separate workers)."""
    from worker.reaper import start_reaper_thread

    return start_reaper_thread(settings=settings).stop


def serve(
    *,
    host: str | None = None,
    port: int | None = None,
    worker: bool | None = None,
    reaper: bool | None = None,
    log_level: str = "info",
) -> int:
    from api.app import create_app
    from api.migrate import upgrade_with_retry

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = get_settings()
    api_settings = get_api_settings()
    host = host or api_settings.host
    port = api_settings.port if port is None else port
    run_worker = settings.embedded if worker is None else worker
    run_reaper = run_worker if reaper is None else reaper

    # Migrate before anything else touches the database (the worker too).
    upgrade_with_retry(settings.resolved_database_url)
    app = create_app(settings, api_settings.model_copy(update={"migrate_on_start": False}))

    stops: list[Callable[[], None]] = []
    try:
        if run_worker:
            stops.append(start_worker(settings, reaper=run_reaper))
        elif run_reaper:
            stops.append(start_reaper(settings))
        log.info(
            "starting the ZenFlow API (database %s, broker %s, %s)",
            _redact(settings.resolved_database_url),
            _redact(settings.resolved_broker_url),
            "embedded worker" if run_worker else "no worker in this process",
        )
        with _after_uvicorn_signals():
            config = uvicorn.Config(
                app, host=host, port=port, log_level=log_level, lifespan="on", **uvicorn_options(api_settings)
            )
            _ReadyServer(config).run()
    finally:
        for stop in reversed(stops):
            try:
                stop()
            except Exception:  # pragma: no cover - best effort at shutdown
                log.exception("error while stopping a background service")
    return 0


#: What stops ``zenflow serve`` cleanly: uvicorn's own (Ctrl-C, ``kill``) and SIGHUP, which a terminal's
#: process group gets when the terminal is closed. Python's default for SIGHUP ends the process at once,
#: with no shutdown: the embedded worker's job was left running and a server in a session of its own
#: (the demo's) lived on with no terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _ReadyServer(uvicorn.Server):
    """uvicorn's server that logs ``ZenFlow API ready on URL`` once it accepts connections: after the
    app's startup (migrations, the worker's capacity, the check pool) and the socket's bind, not before;
    SIGHUP stops it as SIGTERM does."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = signal.signal(signal.SIGHUP, self.handle_exit)
            try:
                yield
            finally:
                signal.signal(signal.SIGHUP, previous)  # uvicorn re-raises it after: _after_uvicorn_signals

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            url = ready_url(self.config.host, self.config.port)
            log.info("ZenFlow API ready on %s", url)
            log.info("console %s%s/, API reference %s%s/", url, CONSOLE_PATH, url, DOCS_PATH)


def ready_url(host: str, port: int) -> str:
    """The base URL a client uses (an IPv6 host in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@contextlib.contextmanager
def _after_uvicorn_signals() -> Iterator[None]:
    """uvicorn re-raises the SIGINT/SIGTERM/SIGHUP that stopped it once it has shut down; catch that here
    so the embedded worker is still stopped cleanly (its job preempted and re-queued) and we exit 0."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(sig: int, _frame: object) -> None:
        log.info("%s: shutting down", signal.Signals(sig).name)

    previous = {sig: signal.signal(sig, note) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url.split("@")[-1]

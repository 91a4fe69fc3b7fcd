"""Helpers shared by the test packages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parents[1]


def unavailable(reason: str) -> NoReturn:
    """A service or tool the suite needs is missing: skip locally, but fail in CI (``CI=true``), where
    .ci/run and the bootstrap provide everything, so a missing piece can never pass as a skip."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"required for CI: {reason}", pytrace=False)
    pytest.skip(reason)


def cpu_adam_extension() -> ModuleType:
    """The built C++ CPU optimizer, or :func:`unavailable` (a test module's fixture calls this)."""
    from offload.cpu_adam import CpuAdamBuildError, load_extension

    try:
        return load_extension()
    except CpuAdamBuildError as exc:  # pragma: no cover - only without a toolchain
        unavailable(f"CPU Adam extension unavailable: {exc}")


def _no_services() -> None:
    """Under ``make test-fast`` (ZENFLOW_TEST_NO_SERVICES=1) a test that reaches PostgreSQL or Redis is
    missing its ``services`` marker (tests/conftest.py): fail it, never connect."""
    if os.environ.get("ZENFLOW_TEST_NO_SERVICES", "").lower() in ("1", "true", "yes"):
        pytest.fail(
            "this test reaches PostgreSQL or Redis: mark it `services` (pytestmark), or request a "
            "fixture of tests/conftest.py's SERVICE_FIXTURES, so that make test-fast leaves it out",
            pytrace=False,
        )


#: The local services (override with ZENFLOW_TEST_POSTGRES_URL / ZENFLOW_TEST_REDIS_URL).
PG_ADMIN_URL = os.environ.get(
    "ZENFLOW_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("ZENFLOW_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def pg_admin(sql: str, **params: object) -> list[object]:
    """Run one statement on the server's admin database (autocommit); its rows, if any."""
    from sqlalchemy import create_engine, text

    _no_services()

    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            res = conn.execute(text(sql), params)
            return list(res) if res.returns_rows else []
    finally:
        admin.dispose()


def create_database(prefix: str) -> str:
    """A new, empty PostgreSQL database with a unique name, so parallel runs never collide; its URL."""
    import secrets

    from sqlalchemy.engine import make_url

    name = f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"
    try:
        pg_admin(f'CREATE DATABASE "{name}"')
    except Exception as exc:
        unavailable(f"PostgreSQL not reachable at {PG_ADMIN_URL}: {exc}")
    return make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)


def drop_database(url: str) -> None:
    """Drop a database made by :func:`create_database`, even if a test left it refusing connections."""
    import contextlib

    from sqlalchemy.engine import make_url

    name = make_url(url).database
    with contextlib.suppress(Exception):
        pg_admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
    pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def database_with_schema(prefix: str) -> Iterator[str]:
    """A fresh PostgreSQL database with every store.orm table (create_all); dropped afterwards."""
    from sqlalchemy import create_engine

    from store.db import get_engine
    from store.orm import Base

    url = create_database(prefix)
    eng = create_engine(url)
    Base.metadata.create_all(eng)
    eng.dispose()
    try:
        yield url
    finally:
        get_engine(url).dispose()
        drop_database(url)


def require_redis(url: str = REDIS_URL) -> str:
    """``url`` after checking that the Redis there answers."""
    import redis

    _no_services()

    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except Exception as exc:
        unavailable(f"Redis not reachable at {url}: {exc}")
    return url


def stop_process_group(proc: subprocess.Popen[bytes], *, grace: float = 60.0) -> None:
    """SIGTERM a server started with ``start_new_session=True`` and its children, SIGKILL after ``grace``."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def startup_seconds() -> float:
    """Wall seconds, measured now, to start a Python process that imports the job runner: what a worker
    does for every job it claims, and a gauge of how slow this machine is at the moment (about 1.7 s on
    a quiet 2-core box, several times that under load)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZENFLOW_")}
    t = time.monotonic()
    subprocess.run(
        [sys.executable, "-c", "import worker.job.runner"], cwd=ROOT, env=env, check=True, timeout=300
    )
    return time.monotonic() - t


def heartbeat_timeout(interval: float) -> float:
    """A ``heartbeat_timeout_seconds`` that a live job's heartbeat, beaten every ``interval`` seconds,
    cannot outrun on this machine as loaded now, for tests that wait for a dead worker's job to be reaped.

    The longest a live job goes without a beat is an interval plus how late one beat is: a database
    round trip and a wake-up, and at each start the claim to the first beat (the worker beats while it
    waits on the runner, worker/task.py; the runner's own first beat comes only after its start-up,
    :func:`startup_seconds`). Four intervals and four start-ups cover both with room for the load to
    rise meanwhile; never under the 4 s the tests used on a quiet machine."""
    return max(4.0, 4 * interval + 4 * startup_seconds())

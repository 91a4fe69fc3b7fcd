"""Helpers shared by the test packages."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import pytest


def unavailable(reason: str) -> NoReturn:
    """A service or tool the suite needs is missing: skip locally, but fail in CI (``CI=true``), where
    .ci/run and the bootstrap provide everything, so a missing piece can never pass as a skip."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"required for CI: {reason}", pytrace=False)
    pytest.skip(reason)


#: The local services (override with ZENFLOW_TEST_POSTGRES_URL / ZENFLOW_TEST_REDIS_URL).
PG_ADMIN_URL = os.environ.get(
    "ZENFLOW_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("ZENFLOW_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def pg_admin(sql: str, **params: object) -> list[object]:
    """Run one statement on the server's admin database (autocommit); its rows, if any."""
    from sqlalchemy import create_engine, text

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

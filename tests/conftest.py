"""Shared fixtures: a private PostgreSQL database per test session (tables from the ORM models), the
local Redis broker, and service settings pointing at them.

PostgreSQL: ``postgresql+psycopg://postgres@127.0.0.1:5432`` (trust auth); a database with a random
name is created for the session and dropped after, so parallel runs never collide. Redis:
``redis://127.0.0.1:6379/0``; tests isolate themselves with unique queue names. Override with
ZENFLOW_TEST_POSTGRES_URL / ZENFLOW_TEST_REDIS_URL. A missing service skips locally and fails in CI
(tests/support.py).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import database_with_schema, require_redis


@pytest.fixture(scope="session")
def pg_db_url() -> Iterator[str]:
    """URL of a fresh PostgreSQL database with all store.orm tables (create_all), for this session."""
    from store.db import get_engine

    with database_with_schema("zf_test") as url:
        yield url
    get_engine.cache_clear()


@pytest.fixture(scope="session")
def redis_broker_url() -> str:
    """The local Redis, checked reachable."""
    return require_redis()


@pytest.fixture
def unique_queue(redis_broker_url: str) -> Iterator[str]:
    """A queue name no one else uses; its Redis keys are deleted afterwards."""
    import redis

    name = f"zf-test-{secrets.token_hex(6)}"
    yield name
    r = redis.Redis.from_url(redis_broker_url)
    for key in r.scan_iter(f"*{name}*"):
        r.delete(key)


@pytest.fixture
def service_env(pg_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """ZENFLOW_* environment for the session database and a private data dir (settings cache cleared)."""
    from store.settings import get_settings

    env = {
        "ZENFLOW_DATABASE_URL": pg_db_url,
        "ZENFLOW_DATA_DIR": str(tmp_path / "var"),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    yield env
    get_settings.cache_clear()


@pytest.fixture(scope="module")
def torch_single_thread() -> Iterator[None]:
    """One intra-op thread for tiny models: on a loaded 2-core machine OpenMP spinning otherwise
    makes a 64-wide matmul take milliseconds. Restored afterwards."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

"""A database that accepts bytes and never answers (a stopped proxy, a frozen host, a stuck pooler):
every wait on it is bounded (store.db, store.db_deadline), so the API answers ``/readyz`` 503 within
about its readiness timeout and a request 503 ``database_unavailable`` within the pool's check plus a
connect, instead of hanging; and it recovers by itself once the database answers again.

The API is a real process whose database URL goes through a TCP proxy (tests/tcp_proxy.py) that the
test freezes with ``SIGSTOP``: the kernel keeps accepting and acknowledging on its sockets, so TCP sees
a healthy peer and only a client-side bound can end the wait.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from store.settings import Settings
from tests import tcp_proxy
from tests.faults.harness import Stack, create_database, wait_until
from tests.support import REDIS_URL, drop_database, require_redis

pytestmark = [pytest.mark.services, pytest.mark.timeout(300)]

#: The defaults this test shows: what the issue asks of them (503 from /readyz within 3 s, from a
#: request within 10 s) is their sum plus a second of slack for the HTTP round trip on a loaded box.
DEFAULTS = Settings()
READYZ_BOUND = 2.0 + 1.0  # ApiSettings.readiness_timeout_seconds, + slack
REQUEST_BOUND = DEFAULTS.database_ping_timeout_seconds + DEFAULTS.database_connect_timeout_seconds + 1.0


@pytest.fixture
def proxied_db() -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A migrated private database and its URL through a proxy process (stopped and resumed by tests)."""
    url = create_database("zf_pgfrozen")
    u = make_url(url)
    proxy, port = tcp_proxy.start(u.host or "127.0.0.1", u.port or 5432)
    try:
        yield u.set(host="127.0.0.1", port=port).render_as_string(hide_password=False), proxy
    finally:
        tcp_proxy.thaw(proxy)
        proxy.kill()
        proxy.wait()
        drop_database(url)


def _timed(fn: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = fn()
    return r, time.monotonic() - t0


def test_frozen_database_is_503_within_bounds_then_recovers(
    tmp_path: Path, proxied_db: tuple[str, subprocess.Popen[str]]
) -> None:
    db_url, proxy = proxied_db
    require_redis()
    st = Stack(tmp=tmp_path, database_url=db_url, broker_url=REDIS_URL)
    (tmp_path / "data").mkdir()
    try:
        _, key = st.create_team_key()
        api = httpx.Client(base_url=st.start_api(), headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert api.get("/v1/files").status_code == 200  # a pooled connection, the key cached
        assert api.get("/readyz").status_code == 200

        tcp_proxy.freeze(proxy)
        r, took = _timed(lambda: api.get("/readyz"))
        assert r.status_code == 503 and took < READYZ_BOUND, (r.status_code, took, r.text)
        print(f"frozen database: /readyz 503 in {took:.2f} s")  # shown with -s
        checks = r.json()["checks"]
        assert checks["database"]["status"] == "unavailable" and checks["broker"]["status"] == "ok", checks
        for _ in range(2):  # the pooled connection fails its check, then a new one its connect
            r, took = _timed(lambda: api.get("/v1/files"))
            assert r.status_code == 503 and took < REQUEST_BOUND, (r.status_code, took, r.text)
            print(f"frozen database: GET /v1/files 503 in {took:.2f} s")
            assert r.json()["error"]["code"] == "database_unavailable" and r.headers["retry-after"]
        assert api.get("/healthz").status_code == 200  # liveness is not the database's

        tcp_proxy.thaw(proxy)
        wait_until(lambda: api.get("/readyz").status_code == 200, 30, "/readyz once the database answers")
        assert api.get("/v1/files").status_code == 200
    finally:
        tcp_proxy.thaw(proxy)
        st.stop_all()


def test_an_operation_on_an_open_connection_ends_at_its_bound(
    proxied_db: tuple[str, subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A statement on a connection already checked out (no pool check between) is cut at the operation
    bound, the connection is dropped, and the engine connects again once the database answers."""
    from store import settings as settings_mod
    from store.db import make_engine

    db_url, proxy = proxied_db
    monkeypatch.setenv("ZENFLOW_DATABASE_OPERATION_TIMEOUT_SECONDS", "1.5")
    settings_mod.get_settings.cache_clear()
    try:
        engine = make_engine(db_url)
    finally:
        monkeypatch.undo()
        settings_mod.get_settings.cache_clear()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT 1")).scalar() == 1
        tcp_proxy.freeze(proxy)
        t0 = time.monotonic()
        with pytest.raises(Exception, match=r"did not answer within 1\.5 s") as err:
            conn.execute(text("SELECT 2"))
        took = time.monotonic() - t0
        assert 1.4 < took < 1.5 + 1.0, took
        assert getattr(err.value, "connection_invalidated", False), err.value
    tcp_proxy.thaw(proxy)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT 3")).scalar() == 3
    engine.dispose()

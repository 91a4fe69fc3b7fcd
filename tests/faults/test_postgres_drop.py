"""PostgreSQL connections dropped under the API: it answers 503 while the database cannot be reached
and recovers by itself once it can.

The shared PostgreSQL server is left running: the test works on a private database, kills the API's
own backends with ``pg_terminate_backend`` (found by the ``application_name`` the API connects with)
and, for the outage, refuses new connections to that database only (``ALLOW_CONNECTIONS false``).
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import make_url

from api.core.config import ApiSettings
from store.settings import Settings
from tests.faults.harness import create_database, wait_until
from tests.support import drop_database, pg_admin

pytestmark = [pytest.mark.services, pytest.mark.timeout(300)]


def _terminate(app_name: str) -> int:
    rows = pg_admin(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = :n", n=app_name
    )
    return sum(1 for (ok,) in rows if ok)


@pytest.fixture
def db_url():
    url = create_database("zf_pgdrop")
    yield url
    drop_database(url)


def test_connections_dropped_then_503_then_recovery(tmp_path: Path, db_url: str) -> None:
    from api.app import create_app
    from api.core.auth import create_key, create_team
    from store.db import session_scope

    with session_scope(db_url) as s:
        _, key = create_key(s, create_team(s, "pg-drop"))
    app_name = f"zf-fault-{secrets.token_hex(4)}"
    api_url = (
        make_url(db_url)
        .update_query_dict({"application_name": app_name})
        .render_as_string(hide_password=False)
    )
    settings = Settings(data_dir=tmp_path, database_url=api_url, broker_url="memory://")
    app = create_app(settings, ApiSettings(migrate_on_start=False), enqueue=lambda *_: None)
    name = make_url(db_url).database
    h = {"Authorization": f"Bearer {key}"}
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.get("/v1/fine_tuning/jobs", headers=h).status_code == 200
        # 1. the pooled connections are killed: pool_pre_ping notices, the next request just works
        assert _terminate(app_name) >= 1
        assert c.get("/v1/fine_tuning/jobs", headers=h).status_code == 200

        # 2. the database goes away for the API: 503 in the OpenAI error shape, liveness unaffected
        pg_admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        try:
            assert _terminate(app_name) >= 1
            for path in ("/v1/fine_tuning/jobs", "/v1/files"):
                r = c.get(path, headers=h)
                assert r.status_code == 503, (path, r.status_code, r.text)
                err = r.json()["error"]
                assert err["code"] == "database_unavailable" and err["type"] == "server_error"
                assert r.headers.get("retry-after")
            r = c.post(
                "/v1/fine_tuning/jobs", headers=h, json={"model": "tiny-llama", "training_file": "file-x"}
            )
            assert r.status_code == 503, r.text
            assert c.get("/healthz").status_code == 200
            assert c.get("/readyz").status_code == 503
            m = c.get("/metrics")
            assert m.status_code == 200 and "zenflow_db_up 0.0" in m.text
        finally:
            pg_admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')

        # 3. back: the very next requests succeed, no restart needed
        wait_until(lambda: c.get("/v1/fine_tuning/jobs", headers=h).status_code == 200, 10, "recovery")
        assert c.get("/v1/files", headers=h).status_code == 200
        assert c.get("/readyz").status_code in (200, 503)  # the broker probe is not this test's business
        assert "zenflow_db_up 1.0" in c.get("/metrics").text

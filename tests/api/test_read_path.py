"""The read path: list and retrieve are one SQL statement each and agree on queue positions (all
teams, per queue, by fair share: store.fairshare); the per-process key cache and the throttled
``last_used_at``."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import event, update

from api.core.config import ApiSettings
from store.orm import ApiKey, FineTuningJob
from tests.api.conftest import TeamKey, make_team, uploaded_id

JOBS = "/v1/fine_tuning/jobs"


@contextmanager
def statements(app: FastAPI) -> Iterator[list[str]]:
    seen: list[str] = []

    def record(_conn, _cursor, statement, _params, _context, _many):  # type: ignore[no-untyped-def]
        seen.append(statement)

    engine = app.state.engine
    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


def test_queue_positions_in_one_query(
    client: TestClient, app: FastAPI, team: TeamKey, other_team: TeamKey
) -> None:
    fid = uploaded_id(client, team)
    q1, q2 = f"q1-{secrets.token_hex(4)}", f"q2-{secrets.token_hex(4)}"
    t0 = datetime(2021, 1, 1, tzinfo=UTC)
    at = [t0 + timedelta(seconds=i) for i in range(6)]
    # The other team's job comes first in q1 (team already runs one there: its first waiting job is in
    # round two); team's own jobs follow in creation order, two created at the same instant by id.
    specs = [  # (team, queue, status, created_at, expected queue_position)
        (other_team, q1, "queued", at[0], 1),
        (team, q1, "queued", at[1], 2),
        (team, q1, "running", at[2], None),
        (team, q1, "queued", at[3], 3),  # created at the same instant: 3 and 4, in id order
        (team, q1, "queued", at[3], 3),
        (team, q1, "validating_files", at[4], 5),
        (team, q1, "cancelled", at[5], None),
        (team, q2, "queued", at[2], 1),
    ]
    with app.state.sessionmaker() as s:
        rows = [
            FineTuningJob(
                team_id=t.id,
                model="tiny-llama",
                training_file_id=fid,
                status=st,
                queue=q,
                created_at=ts,
            )
            for t, q, st, ts, _ in specs
        ]
        s.add_all(rows)
        s.commit()
        mine = [(r.id, st, pos) for r, (t, _, st, _, pos) in zip(rows, specs, strict=True) if t is team]
    tied = sorted(job_id for job_id, _, pos in mine if pos == 3)
    mine = [(job_id, st, 4 if job_id == tied[1] else pos) for job_id, st, pos in mine]
    expected = {job_id: pos for job_id, _, pos in mine}

    assert client.get(JOBS, headers=team.headers).status_code == 200  # the key is cached from here on
    with statements(app) as seen:
        listed = client.get(JOBS, params={"limit": 100}, headers=team.headers).json()
    assert len(seen) == 1, seen
    assert {j["id"]: j["queue_position"] for j in listed["data"]} == expected
    # pages agree with the whole list
    paged: dict[str, int | None] = {}
    after = None
    while True:
        params: dict[str, str | int] = {"limit": 3, **({"after": after} if after else {})}
        p = client.get(JOBS, params=params, headers=team.headers).json()
        paged.update({j["id"]: j["queue_position"] for j in p["data"]})
        if not p["has_more"]:
            break
        after = p["last_id"]
    assert paged == expected
    queued_only = client.get(JOBS, params={"status": "queued"}, headers=team.headers).json()["data"]
    assert {j["id"]: j["queue_position"] for j in queued_only} == {
        job_id: pos for job_id, st, pos in mine if st == "queued"
    }
    for job_id, pos in expected.items():
        with statements(app) as seen:
            got = client.get(f"{JOBS}/{job_id}", headers=team.headers).json()
        assert len(seen) == 1, seen
        assert got["queue_position"] == pos, (job_id, got["status"])


def _app_with(app: FastAPI, **api: float) -> FastAPI:
    from api.app import create_app

    return create_app(
        app.state.settings,
        ApiSettings(_env_file=None, migrate_on_start=False, **api),  # type: ignore[call-arg]
        enqueue=app.state.enqueue,
    )


def test_key_cache_ttl_and_throttled_touch(app: FastAPI) -> None:
    """A key revoked by another process (a direct database write) is refused once the cache entry
    expires; cached requests neither read the key nor write ``last_used_at``."""
    app2 = _app_with(app, key_cache_seconds=0.5, key_touch_seconds=60)
    t = make_team(app2)
    try:
        with TestClient(app2) as c:
            assert c.get("/v1/files", headers=t.headers).status_code == 200
            with statements(app2) as seen:
                for _ in range(5):
                    assert c.get("/v1/files", headers=t.headers).status_code == 200
            assert not [q for q in seen if "api_keys" in q], seen
            with app2.state.sessionmaker() as s:
                s.execute(update(ApiKey).where(ApiKey.team_id == t.id).values(revoked_at=datetime.now(UTC)))
                s.commit()
            # within the TTL this process still honours it; after it, the revocation holds
            assert c.get("/v1/files", headers=t.headers).status_code == 200
            time.sleep(0.6)
            assert c.get("/v1/files", headers=t.headers).status_code == 401
    finally:
        app2.state.engine.dispose()


def test_key_cache_off(app: FastAPI) -> None:
    app2 = _app_with(app, key_cache_seconds=0, key_touch_seconds=60)
    t = make_team(app2)
    try:
        with TestClient(app2) as c:
            assert c.get("/v1/files", headers=t.headers).status_code == 200
            with statements(app2) as seen:
                assert c.get("/v1/files", headers=t.headers).status_code == 200
            key_reads = [q for q in seen if "api_keys" in q]
            assert len(key_reads) == 1 and key_reads[0].lstrip().upper().startswith("SELECT"), seen
            with app2.state.sessionmaker() as s:
                s.execute(update(ApiKey).where(ApiKey.team_id == t.id).values(revoked_at=datetime.now(UTC)))
                s.commit()
            assert c.get("/v1/files", headers=t.headers).status_code == 401
    finally:
        app2.state.engine.dispose()

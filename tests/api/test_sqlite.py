"""The same API on the embedded default (SQLite file under data_dir, migrated on start)."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient

from api.app import create_app
from api.core.config import ApiSettings
from store.settings import Settings
from tests.api.conftest import Enqueued, chat_jsonl, error_of, make_team


def test_embedded_sqlite_flow(tmp_path: Path) -> None:
    settings = Settings(_env_file=None, data_dir=tmp_path / "var")  # type: ignore[call-arg]
    assert settings.embedded and settings.resolved_database_url.startswith("sqlite:///")
    enq = Enqueued()
    app = create_app(settings, ApiSettings(_env_file=None, stream_poll_seconds=0.05), enqueue=enq)  # type: ignore[call-arg]
    with TestClient(app) as c:  # lifespan: alembic upgrade head on the new file
        assert (tmp_path / "var" / "zenflow.db").is_file()
        t = make_team(app)
        fid = c.post(
            "/v1/files",
            headers=t.headers,
            data={"purpose": "fine-tune"},
            files={"file": ("t.jsonl", chat_jsonl(3))},
        ).json()["id"]
        body = {"model": "tiny-llama", "training_file": fid, "hyperparameters": {"n_epochs": 1}}
        jobs = [
            c.post(
                "/v1/fine_tuning/jobs", headers={**t.headers, "Idempotency-Key": f"k{i}"}, json=body
            ).json()
            for i in range(3)
        ]
        assert (
            c.post("/v1/fine_tuning/jobs", headers={**t.headers, "Idempotency-Key": "k0"}, json=body).json()[
                "id"
            ]
            == jobs[0]["id"]
        )
        r = c.post(
            "/v1/fine_tuning/jobs", headers={**t.headers, "Idempotency-Key": "k0"}, json={**body, "seed": 5}
        )
        assert r.status_code == 409
        assert [j["queue_position"] for j in jobs] == [1, 2, 3]
        p1 = c.get("/v1/fine_tuning/jobs", params={"limit": 2}, headers=t.headers).json()
        p2 = c.get(
            "/v1/fine_tuning/jobs", params={"limit": 2, "after": p1["last_id"]}, headers=t.headers
        ).json()
        assert [j["id"] for j in p1["data"] + p2["data"]] == [j["id"] for j in reversed(jobs)]
        assert (
            c.post(f"/v1/fine_tuning/jobs/{jobs[0]['id']}/cancel", headers=t.headers).json()["status"]
            == "cancelled"
        )
        assert c.get(f"/v1/fine_tuning/jobs/{jobs[1]['id']}", headers=t.headers).json()["queue_position"] == 1
        with c.stream(
            "GET", f"/v1/fine_tuning/jobs/{jobs[0]['id']}/events?stream=true", headers=t.headers
        ) as s:
            lines = [x for x in "".join(s.iter_text()).splitlines() if x.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["message"].startswith(
            "Job cancelled"
        )
        r = c.post(
            "/v1/fine_tuning/jobs", headers=t.headers, json={**body, "hyperparameters": {"n_epochs": -2}}
        )
        assert r.status_code == 400 and error_of(r)["param"] == "hyperparameters.n_epochs"
        assert len(enq.calls) == 3
    app.state.engine.dispose()

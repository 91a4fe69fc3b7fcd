"""Per-team quotas at ``POST /v1/fine_tuning/jobs`` (429/400 ``quota_exceeded`` naming the quota, nothing
written) and at ``POST /v1/files`` (the storage quota: 400, nothing kept), ``GET /v1/quotas`` (limits
and usage), ``zenflow quotas set|show``, and creates or uploads racing for a team's last room (on
PostgreSQL through a real server; creates on SQLite too). The quotas at the claim and while a job runs:
tests/store/test_quota_claims.py, tests/worker/test_job_quotas.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from store import quotas
from store.orm import File, FineTuningJob, JobEvent, JobRun, utcnow
from store.settings import Settings
from tests.api.conftest import (
    TEST_API_SETTINGS,
    Enqueued,
    ServerThread,
    TeamKey,
    chat_jsonl,
    error_of,
    make_team,
    stored_files,
    upload,
    uploaded_id,
)

JOBS = "/v1/fine_tuning/jobs"


def _set(app: FastAPI, team: TeamKey, **values: Any) -> None:
    with app.state.sessionmaker() as s:
        quotas.set_limits(s, team.id, values)
        s.commit()


def _jobs(app: FastAPI, team: TeamKey) -> int:
    with app.state.sessionmaker() as s:
        return int(
            s.scalar(select(func.count()).select_from(FineTuningJob).where(FineTuningJob.team_id == team.id))
            or 0
        )


def _events(app: FastAPI, team: TeamKey) -> int:
    with app.state.sessionmaker() as s:
        return int(
            s.scalar(
                select(func.count())
                .select_from(JobEvent)
                .join(FineTuningJob)
                .where(FineTuningJob.team_id == team.id)
            )
            or 0
        )


def _create(client: TestClient, team: TeamKey, fid: str) -> Any:
    return client.post(JOBS, headers=team.headers, json={"model": "tiny-llama", "training_file": fid})


def test_queued_limit_is_429_naming_it_and_other_teams_are_unaffected(
    client: TestClient, app: FastAPI, team: TeamKey, other_team: TeamKey, enqueued: Enqueued
) -> None:
    fid, other_fid = uploaded_id(client, team), uploaded_id(client, other_team)
    _set(app, team, max_queued_jobs=2)
    first = [_create(client, team, fid) for _ in range(2)]
    assert [r.status_code for r in first] == [200, 200]
    sent, events = len(enqueued.calls), _events(app, team)
    r = _create(client, team, fid)
    assert r.status_code == 429, r.text
    err = error_of(r)
    assert err["code"] == "quota_exceeded" and err["param"] == "max_queued_jobs"
    assert "max_queued_jobs" in err["message"] and "2 of 2" in err["message"]
    # Nothing written for the refused job, nothing sent.
    assert _jobs(app, team) == 2 and _events(app, team) == events and len(enqueued.calls) == sent
    # Another team is not held to this team's quota.
    assert [_create(client, other_team, other_fid).status_code for _ in range(3)] == [200, 200, 200]
    # A slot frees when one of the team's jobs stops waiting.
    cancelled = client.post(f"{JOBS}/{first[0].json()['id']}/cancel", headers=team.headers)
    assert cancelled.json()["status"] == "cancelled"
    assert _create(client, team, fid).status_code == 200


def test_running_limit_holds_jobs_back_and_zero_refuses(
    client: TestClient, app: FastAPI, team: TeamKey
) -> None:
    """max_running_jobs does not refuse a create (the job waits for the team's turn, see
    tests/api/test_fair_share.py); 0 does, since no job of the team could ever start."""
    fid = uploaded_id(client, team)
    _set(app, team, max_running_jobs=1)
    assert _create(client, team, fid).status_code == 200
    _set(app, team, max_running_jobs=0)
    r = _create(client, team, fid)
    assert r.status_code == 400 and error_of(r)["code"] == "quota_exceeded"
    assert error_of(r)["param"] == "max_running_jobs" and _jobs(app, team) == 1


def test_gpu_hours_is_429_with_retry_after(client: TestClient, app: FastAPI, team: TeamKey) -> None:
    fid = uploaded_id(client, team)
    now = utcnow()
    with app.state.sessionmaker() as s:
        # 2 GPUs for an hour that ended an hour ago: 2 GPU-hours in the last 30 days.
        s.add(
            JobRun(
                team_id=team.id,
                queue="q",
                gpus=2,
                started_at=now - timedelta(hours=2),
                ended_at=now - timedelta(hours=1),
                gpu_seconds=7200.0,
            )
        )
        s.commit()
    _set(app, team, gpu_hours=3)
    assert _create(client, team, fid).status_code == 200
    _set(app, team, gpu_hours=1.5)
    r = _create(client, team, fid)
    assert r.status_code == 429 and error_of(r)["param"] == "gpu_hours", r.text
    assert "2.00 of 1.5 GPU-hours" in error_of(r)["message"]
    # The run leaves the 30-day window 30 days after it ended: 30 days less an hour from now.
    retry = int(r.headers["Retry-After"])
    expected = timedelta(days=30, hours=-1).total_seconds()
    assert expected - 120 <= retry <= expected + 1, retry
    _set(app, team, gpu_hours=0)
    r = _create(client, team, fid)
    assert r.status_code == 400 and error_of(r)["param"] == "gpu_hours" and _jobs(app, team) == 1


def test_storage_quota_is_400(client: TestClient, app: FastAPI, team: TeamKey) -> None:
    fid = uploaded_id(client, team)
    _set(app, team, storage_bytes=100)  # the upload alone is more
    r = _create(client, team, fid)
    assert r.status_code == 400 and error_of(r)["code"] == "quota_exceeded", r.text
    assert error_of(r)["param"] == "storage_bytes" and "bytes stored" in error_of(r)["message"]
    assert _jobs(app, team) == 0
    _set(app, team, storage_bytes=None)  # back to the server's default: unlimited
    assert _create(client, team, fid).status_code == 200


def _team_files(app: FastAPI, team: TeamKey) -> int:
    with app.state.sessionmaker() as s:
        return int(s.scalar(select(func.count()).select_from(File).where(File.team_id == team.id)) or 0)


def test_upload_over_the_storage_quota_is_refused_and_nothing_kept(
    client: TestClient, app: FastAPI, team: TeamKey, settings: Settings
) -> None:
    """Room for two and a half files: the third is cut off as it streams past the room left, a team
    with no room is refused before its body is read, and nothing of a refused upload stays on disk."""
    content = chat_jsonl(8)
    n = len(content)
    _set(app, team, storage_bytes=2 * n + n // 2)
    assert [upload(client, team, content).status_code for _ in range(2)] == [200, 200]
    kept = stored_files(settings)
    r = upload(client, team, content)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert (err["code"], err["param"]) == ("quota_exceeded", "storage_bytes")
    assert err["message"].startswith(
        f"Quota storage_bytes exceeded: the team stores {2 * n:,} of {2 * n + n // 2:,} bytes and this file is "
        f"larger than the {n // 2:,} bytes left; nothing was kept"
    ), err["message"]
    assert _team_files(app, team) == 2 and stored_files(settings) == kept  # no temp file, no placed file
    _set(app, team, storage_bytes=2 * n)
    r = upload(client, team, b"x")
    assert r.status_code == 400 and "larger than the 0 bytes left" in error_of(r)["message"], r.text
    assert _team_files(app, team) == 2 and stored_files(settings) == kept
    _set(app, team, storage_bytes=None)
    assert upload(client, team, content).status_code == 200 and _team_files(app, team) == 3


def test_quota_endpoint_shows_limits_and_usage(
    client: TestClient, app: FastAPI, team: TeamKey, other_team: TeamKey
) -> None:
    body = client.get("/v1/quotas", headers=team.headers).json()
    assert body["object"] == "organization.quota" and body["organization_id"] == team.id
    assert body["limits"] == {
        "max_running_jobs": None,
        "max_queued_jobs": None,
        "gpu_hours": None,
        "storage_bytes": None,
    }
    assert body["usage"] == {"running_jobs": 0, "queued_jobs": 0, "gpu_hours": 0.0, "storage_bytes": 0}
    assert body["custom"] == [] and body["period_days"] == 30
    fid = uploaded_id(client, team)
    _create(client, team, fid)
    _set(app, team, max_queued_jobs=5, gpu_hours=10)
    with app.state.sessionmaker() as s:  # half an hour of one GPU, still running
        s.add(JobRun(team_id=team.id, queue="q", gpus=1, started_at=utcnow() - timedelta(minutes=30)))
        s.commit()
    body = client.get("/v1/quotas", headers=team.headers).json()
    assert body["limits"]["max_queued_jobs"] == 5 and body["limits"]["gpu_hours"] == 10
    assert body["custom"] == ["max_queued_jobs", "gpu_hours"]
    with app.state.sessionmaker() as s:
        stored = s.scalar(select(func.sum(File.bytes)).where(File.team_id == team.id))
    assert body["usage"]["queued_jobs"] == 1 and body["usage"]["storage_bytes"] == stored > 0
    assert 0.49 < body["usage"]["gpu_hours"] < 0.6
    # Each team sees its own.
    other = client.get("/v1/quotas", headers=other_team.headers).json()
    assert other["organization_id"] == other_team.id and other["usage"]["queued_jobs"] == 0
    assert other["limits"]["max_queued_jobs"] is None
    assert client.get("/v1/quotas").status_code == 401


# --- two creates racing for the last slot --------------------------------------------------------------

RACERS = 8


def _race(base_url: str, team: TeamKey, fid: str) -> list[int]:
    barrier = threading.Barrier(RACERS, timeout=30)
    codes: list[int] = [0] * RACERS

    def call(i: int) -> None:
        with httpx.Client(base_url=base_url, timeout=60) as c:
            barrier.wait()
            codes[i] = c.post(
                JOBS, headers=team.headers, json={"model": "tiny-llama", "training_file": fid}
            ).status_code

    threads = [threading.Thread(target=call, args=(i,)) for i in range(RACERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "a caller did not finish"
    return codes


@pytest.fixture(scope="module")
def server(settings: Settings) -> Iterator[tuple[FastAPI, ServerThread]]:
    from api.app import create_app

    app = create_app(settings, TEST_API_SETTINGS, enqueue=Enqueued())
    with ServerThread(app) as s:
        yield app, s


def test_racing_creates_at_limit_one_give_one_job(server: tuple[FastAPI, ServerThread]) -> None:
    app, srv = server
    team = make_team(app)
    with httpx.Client(base_url=srv.base_url) as c:
        fid = c.post(
            "/v1/files",
            headers=team.headers,
            data={"purpose": "fine-tune"},
            files={"file": ("t.jsonl", _jsonl())},
        ).json()["id"]
    _set(app, team, max_queued_jobs=1)
    codes = _race(srv.base_url, team, fid)
    assert sorted(codes) == [200] + [429] * (RACERS - 1), codes
    assert _jobs(app, team) == 1


def test_racing_uploads_fill_the_storage_quota_exactly(server: tuple[FastAPI, ServerThread]) -> None:
    """Eight uploads at once with room for three: each streams within the room it saw, and the check
    under the team's row lock before the row is written keeps three."""
    app, srv = server
    team = make_team(app)
    content = _jsonl()
    _set(app, team, storage_bytes=3 * len(content) + len(content) // 2)
    barrier = threading.Barrier(RACERS, timeout=30)
    codes: list[int] = [0] * RACERS

    def call(i: int) -> None:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            barrier.wait()
            codes[i] = c.post(
                "/v1/files",
                headers=team.headers,
                data={"purpose": "fine-tune"},
                files={"file": ("t.jsonl", content)},
            ).status_code

    threads = [threading.Thread(target=call, args=(i,)) for i in range(RACERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "an upload did not finish"
    assert sorted(codes) == [200] * 3 + [400] * (RACERS - 3), codes
    assert _team_files(app, team) == 3
    with app.state.sessionmaker() as s:
        assert quotas.storage_bytes(s, team.id) == 3 * len(content)


def test_racing_creates_on_sqlite(tmp_path: Path) -> None:
    from api.app import create_app

    settings = Settings(_env_file=None, data_dir=tmp_path / "var")  # type: ignore[call-arg]
    app = create_app(
        settings, TEST_API_SETTINGS.model_copy(update={"migrate_on_start": True}), enqueue=Enqueued()
    )
    with TestClient(app), ServerThread(app) as srv:
        team = make_team(app)
        with httpx.Client(base_url=srv.base_url) as c:
            fid = c.post(
                "/v1/files",
                headers=team.headers,
                data={"purpose": "fine-tune"},
                files={"file": ("t.jsonl", _jsonl())},
            ).json()["id"]
        _set(app, team, max_queued_jobs=1)
        codes = _race(srv.base_url, team, fid)
        assert sorted(codes) == [200] + [429] * (RACERS - 1), codes
        assert _jobs(app, team) == 1


def _jsonl() -> bytes:
    from tests.api.conftest import chat_jsonl

    return chat_jsonl(4)


# --- the CLI -------------------------------------------------------------------------------------------


@pytest.fixture
def cli_env(pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from store.settings import get_settings

    monkeypatch.setenv("ZENFLOW_DATABASE_URL", pg_url)
    monkeypatch.setenv("ZENFLOW_DATA_DIR", str(tmp_path / "var"))
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_cli_sets_and_shows_quotas(
    cli_env: None, client: TestClient, app: FastAPI, team: TeamKey, capsys: pytest.CaptureFixture[str]
) -> None:
    from api.cli.main import main

    assert (
        main(
            [
                "quotas",
                "set",
                "--team",
                team.name,
                "--max-running-jobs",
                "2",
                "--max-queued-jobs",
                "10",
                "--gpu-hours",
                "100",
                "--storage-gib",
                "50",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "max_queued_jobs   limit 10" in out and "(team)" in out and "53,687,091,200 bytes" in out
    limits = client.get("/v1/quotas", headers=team.headers).json()["limits"]
    assert limits == {
        "max_running_jobs": 2,
        "max_queued_jobs": 10,
        "gpu_hours": 100.0,
        "storage_bytes": 50 * 2**30,
    }
    # Only the quotas given change; "default" puts one back to the server's default.
    assert main(["quotas", "set", "--team", team.id, "--max-queued-jobs", "default"]) == 0
    capsys.readouterr()
    assert main(["quotas", "show", "--team", team.name]) == 0
    out = capsys.readouterr().out
    assert "max_queued_jobs   limit unlimited" in out and "max_running_jobs  limit 2" in out
    assert client.get("/v1/quotas", headers=team.headers).json()["limits"]["max_queued_jobs"] is None
    # A quota set from the CLI is enforced by the API.
    assert main(["quotas", "set", "--team", team.name, "--max-queued-jobs", "0"]) == 0
    fid = uploaded_id(client, team)
    assert _create(client, team, fid).status_code == 429
    assert main(["quotas", "show", "--team", "no-such-team"]) == 1
    assert main(["quotas", "set", "--team", team.name]) == 2
    with pytest.raises(SystemExit):
        main(["quotas", "set", "--team", team.name, "--gpu-hours", "-1"])
    assert "error" in capsys.readouterr().err


def test_gpu_seconds_count_only_the_window(app: FastAPI, team: TeamKey, other_team: TeamKey) -> None:
    from store.runs import gpu_seconds

    now = utcnow()
    with app.state.sessionmaker() as s:
        s.add_all(
            [
                # two days, one of them inside the 30-day window
                JobRun(
                    team_id=team.id,
                    queue="q",
                    gpus=1,
                    started_at=now - timedelta(days=31),
                    ended_at=now - timedelta(days=29),
                    gpu_seconds=2 * 86400.0,
                ),
                JobRun(
                    team_id=team.id,
                    queue="q",
                    gpus=2,
                    started_at=now - timedelta(hours=2),
                    ended_at=now - timedelta(hours=1),
                    gpu_seconds=7200.0,
                ),
                JobRun(
                    team_id=team.id, queue="q", gpus=1, started_at=now - timedelta(minutes=10)
                ),  # still running
                JobRun(
                    team_id=team.id,
                    queue="q",
                    gpus=8,
                    started_at=now - timedelta(days=40),
                    ended_at=now - timedelta(days=35),
                    gpu_seconds=8 * 5 * 86400.0,
                ),  # before the window
                JobRun(
                    team_id=other_team.id,
                    queue="q",
                    gpus=1,
                    started_at=now - timedelta(hours=1),
                    ended_at=now,
                    gpu_seconds=3600.0,
                ),
            ]
        )
        s.commit()
        used = gpu_seconds(s, team.id, now - timedelta(days=30), now=now)
    assert used == pytest.approx(86400 + 7200 + 600, abs=1)

"""Fixtures of the API tests: a private PostgreSQL database per session, Redis with a private queue,
the app under TestClient, and a fresh team + key per test (team isolation keeps tests apart)."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.core.config import ApiSettings
from store.settings import Settings
from tests.support import create_database, drop_database, require_redis
from trainer.run.launch import free_port


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A migrated PostgreSQL database private to this test session."""
    from api.migrate import upgrade
    from store.db import get_engine

    url = create_database("zf_api")
    upgrade(url)
    yield url
    get_engine.cache_clear()
    drop_database(url)


@pytest.fixture(scope="session")
def redis_url() -> str:
    return require_redis()


@pytest.fixture(scope="session")
def queue_name(redis_url: str) -> Iterator[str]:
    import redis

    name = f"zf-test-api-{secrets.token_hex(4)}"
    yield name
    r = redis.Redis.from_url(redis_url)
    for key in r.scan_iter(f"{name}*"):
        r.delete(key)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zf-api-data")


@pytest.fixture(scope="session")
def settings(pg_url: str, redis_url: str, queue_name: str, data_dir: Path) -> Settings:
    return Settings(
        _env_file=None,  # type: ignore[call-arg]
        data_dir=data_dir,
        database_url=pg_url,
        broker_url=redis_url,
        default_queue=queue_name,
        max_upload_bytes=256 * 1024,
    )


TEST_API_SETTINGS = ApiSettings(
    _env_file=None,  # type: ignore[call-arg]
    migrate_on_start=False,
    stream_poll_seconds=0.05,
    stream_keepalive_seconds=1.0,
    key_touch_seconds=0,
)


@dataclass
class Enqueued:
    """Records enqueue calls of the app under test (the tests without a worker)."""

    calls: list[tuple[str, str]] = field(default_factory=list)
    fail: bool = False

    def __call__(self, job_id: str, queue: str) -> None:
        if self.fail:
            raise ConnectionError("broker down (test)")
        self.calls.append((job_id, queue))


@pytest.fixture(scope="session")
def enqueued() -> Enqueued:
    return Enqueued()


@pytest.fixture(scope="session")
def app(settings: Settings, enqueued: Enqueued) -> FastAPI:
    from api.app import create_app

    return create_app(settings, TEST_API_SETTINGS, enqueue=enqueued)


@pytest.fixture(scope="session")
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as c:
        yield c


@dataclass
class TeamKey:
    id: str
    name: str
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def make_team(app: FastAPI, name: str | None = None) -> TeamKey:
    from api.core.auth import create_key, create_team

    with app.state.sessionmaker() as s:
        team = create_team(s, name or f"team-{secrets.token_hex(4)}")
        _, key = create_key(s, team, "test")
        s.commit()
        return TeamKey(team.id, team.name, key)


@pytest.fixture
def team(app: FastAPI) -> TeamKey:
    return make_team(app)


@pytest.fixture
def other_team(app: FastAPI) -> TeamKey:
    return make_team(app)


def chat_jsonl(n: int = 8) -> bytes:
    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": f"What is {i} + {i}?"},
                    {"role": "assistant", "content": str(2 * i)},
                ]
            }
        )
        for i in range(n)
    ]
    return ("\n".join(lines) + "\n").encode()


def upload(
    client: TestClient,
    team: TeamKey,
    content: bytes | None = None,
    *,
    filename: str = "train.jsonl",
    purpose: str | None = "fine-tune",
) -> Any:
    data = {"purpose": purpose} if purpose is not None else {}
    return client.post(
        "/v1/files",
        headers=team.headers,
        data=data,
        files={"file": (filename, content if content is not None else chat_jsonl(), "application/jsonl")},
    )


def uploaded_id(client: TestClient, team: TeamKey, content: bytes | None = None) -> str:
    r = upload(client, team, content)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def error_of(resp: Any) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    return err


def stored_files(settings: Settings) -> list[Path]:
    root = settings.resolved_files_dir
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


class ServerThread:
    """uvicorn serving an app on a free loopback port in a thread (for real HTTP clients)."""

    def __init__(self, app: FastAPI) -> None:
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        # the app's start-up (its lifespan) takes ~20 s on a 2-core box under a load of 12: a bound, not a wait
        deadline = time.monotonic() + 120
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def team_rows(app: FastAPI, team: TeamKey) -> tuple[int, int]:
    """How many jobs and job events ``team`` has (a refused create must leave both unchanged)."""
    from sqlalchemy import func, select

    from store.orm import FineTuningJob, JobEvent

    with app.state.sessionmaker() as s:
        jobs = s.scalar(
            select(func.count()).select_from(FineTuningJob).where(FineTuningJob.team_id == team.id)
        )
        events = s.scalar(
            select(func.count())
            .select_from(JobEvent)
            .join(FineTuningJob)
            .where(FineTuningJob.team_id == team.id)
        )
        return int(jobs or 0), int(events or 0)

"""Request bodies over ``max_body_bytes`` are refused with 413 before they are parsed; uploads are not."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.core.config import ApiSettings
from store.orm import FineTuningJob
from store.settings import Settings
from tests.api.conftest import TEST_API_SETTINGS, Enqueued, TeamKey, error_of, make_team, upload

LIMIT = 4096


@pytest.fixture(scope="module")
def small_client(settings: Settings, enqueued: Enqueued) -> Iterator[TestClient]:
    from api.app import create_app

    api_settings = ApiSettings.model_validate({**TEST_API_SETTINGS.model_dump(), "max_body_bytes": LIMIT})
    with TestClient(create_app(settings, api_settings, enqueue=enqueued)) as c:
        yield c


@pytest.fixture
def small_team(small_client: TestClient) -> TeamKey:
    return make_team(small_client.app)  # type: ignore[arg-type]


def _job_count(client: TestClient, team: TeamKey) -> int:
    with client.app.state.sessionmaker() as s:  # type: ignore[attr-defined]
        return s.scalar(
            select(func.count()).select_from(FineTuningJob).where(FineTuningJob.team_id == team.id)
        )


def _big_create_body(fid: str, size: int) -> bytes:
    return json.dumps(
        {"model": "tiny-llama", "training_file": fid, "suffix": "x", "metadata": {"pad": "p" * size}}
    ).encode()


def test_declared_length_over_the_cap_is_413_and_writes_nothing(
    small_client: TestClient, small_team: TeamKey
) -> None:
    fid = upload(small_client, small_team).json()["id"]
    r = small_client.post(
        "/v1/fine_tuning/jobs",
        content=_big_create_body(fid, 2 * LIMIT),
        headers={**small_team.headers, "Content-Type": "application/json"},
    )
    assert r.status_code == 413, r.text
    err = error_of(r)
    assert err["code"] == "request_too_large"
    assert str(LIMIT) in err["message"]
    assert _job_count(small_client, small_team) == 0


def test_chunked_body_over_the_cap_is_413(small_client: TestClient, small_team: TeamKey) -> None:
    fid = upload(small_client, small_team).json()["id"]
    body = _big_create_body(fid, 2 * LIMIT)
    chunks = iter([body[i : i + 1000] for i in range(0, len(body), 1000)])  # no Content-Length: chunked
    r = small_client.post(
        "/v1/fine_tuning/jobs",
        content=chunks,
        headers={**small_team.headers, "Content-Type": "application/json"},
    )
    assert r.status_code == 413, r.text
    assert error_of(r)["code"] == "request_too_large"
    assert _job_count(small_client, small_team) == 0


def test_body_under_the_cap_reaches_validation(small_client: TestClient, small_team: TeamKey) -> None:
    """Just under the cap the request is parsed as usual (here: a 400 naming the bad field, not a 413)."""
    fid = upload(small_client, small_team).json()["id"]
    body = json.dumps(
        {
            "model": "tiny-llama",
            "training_file": fid,
            "hyperparameters": {"n_epochs": "many"},
            "suffix": "s" * 10,
        }
    ).encode()
    assert len(body) < LIMIT
    r = small_client.post(
        "/v1/fine_tuning/jobs",
        content=body,
        headers={**small_team.headers, "Content-Type": "application/json"},
    )
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == "hyperparameters.n_epochs"


def test_uploads_are_limited_by_max_upload_bytes_only(small_client: TestClient, small_team: TeamKey) -> None:
    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": f"q{i} " + "w" * 200},
                    {"role": "assistant", "content": "a"},
                ]
            }
        )
        for i in range(40)
    ]
    content = ("\n".join(lines) + "\n").encode()
    assert LIMIT < len(content) < 256 * 1024  # over the body cap, under the upload cap
    r = upload(small_client, small_team, content)
    assert r.status_code == 200, r.text
    assert r.json()["bytes"] == len(content)

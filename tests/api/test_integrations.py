"""Tracking integrations at create: OpenAI's ``wandb`` shape and our ``mlflow``, stored on the job and
shown on the job object; an unknown type, a type the server does not allow, a duplicate: 400s naming
the field, no job written. (The runs themselves: tests/worker/test_tracking.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select

from store.orm import FineTuningJob
from store.settings import Settings
from tests.api.conftest import (
    TEST_API_SETTINGS,
    Enqueued,
    ServerThread,
    TeamKey,
    error_of,
    make_team,
    uploaded_id,
)

JOBS = "/v1/fine_tuning/jobs"
WANDB = {"type": "wandb", "wandb": {"project": "p1", "name": "r1", "entity": "acme", "tags": ["a", "b"]}}
MLFLOW = {"type": "mlflow", "mlflow": {"experiment": "exp", "run_name": "r2", "tags": {"team": "nlp"}}}


def _create(client: TestClient, team: TeamKey, integrations: Any) -> Any:
    fid = uploaded_id(client, team)
    body = {"model": "tiny-llama", "training_file": fid, "integrations": integrations}
    return client.post(JOBS, headers=team.headers, json=body)


def _jobs(app: FastAPI, team: TeamKey) -> list[FineTuningJob]:
    with app.state.sessionmaker() as s:
        return list(s.scalars(select(FineTuningJob).where(FineTuningJob.team_id == team.id)))


def test_integrations_are_stored_and_shown(client: TestClient, app: FastAPI, team: TeamKey) -> None:
    r = _create(client, team, [WANDB, MLFLOW])
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["integrations"] == [WANDB, MLFLOW]
    got = client.get(f"{JOBS}/{job['id']}", headers=team.headers).json()
    assert got["integrations"] == [WANDB, MLFLOW]
    listed = client.get(JOBS, headers=team.headers).json()["data"]
    assert listed[0]["integrations"] == [WANDB, MLFLOW]
    (row,) = _jobs(app, team)
    assert row.integrations == [WANDB, MLFLOW]


def test_mlflow_defaults_and_no_integrations(client: TestClient, app: FastAPI, team: TeamKey) -> None:
    r = _create(client, team, [{"type": "mlflow"}])
    assert r.status_code == 200, r.text
    shown = {"experiment": "zenflow", "run_name": None, "tags": None}  # the job object shows every field
    assert r.json()["integrations"] == [{"type": "mlflow", "mlflow": shown}]
    r = _create(client, team, None)
    assert r.status_code == 200 and r.json()["integrations"] == []
    assert sorted(str(j.integrations) for j in _jobs(app, team)) == sorted(
        ["None", str([{"type": "mlflow", "mlflow": {"experiment": "zenflow"}}])]
    )


@pytest.mark.parametrize(
    ("integrations", "param", "named"),
    [
        ([{"type": "comet", "comet": {}}], "integrations[0]", "comet"),
        ([WANDB, {"type": "neptune"}], "integrations[1]", "neptune"),
        ([WANDB, WANDB], "integrations", "wandb"),
        ([{"type": "wandb", "wandb": {"name": "x"}}], "integrations[0].wandb.project", None),
        ([{"type": "wandb", "wandb": {"project": "p", "color": "red"}}], "integrations[0].wandb.color", None),
        ([{"type": "mlflow", "mlflow": {"tags": ["not", "a", "map"]}}], "integrations[0].mlflow.tags", None),
        ("wandb", "integrations", None),
    ],
)
def test_bad_integrations_are_400_naming_them(
    client: TestClient,
    app: FastAPI,
    team: TeamKey,
    enqueued: Enqueued,
    integrations: Any,
    param: str,
    named: str | None,
) -> None:
    calls = len(enqueued.calls)
    r = _create(client, team, integrations)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == param, err
    if named:
        assert repr(named) in err["message"], err
    assert _jobs(app, team) == [] and len(enqueued.calls) == calls


@pytest.fixture(scope="module")
def wandb_only_client(settings: Settings) -> Iterator[tuple[TestClient, FastAPI]]:
    from api.app import create_app

    app = create_app(
        settings.model_copy(update={"allowed_integrations": ["wandb"]}), TEST_API_SETTINGS, enqueue=Enqueued()
    )
    with TestClient(app) as c:
        yield c, app


def test_a_type_the_server_does_not_allow_is_400(wandb_only_client: tuple[TestClient, FastAPI]) -> None:
    client, app = wandb_only_client
    team = make_team(app)
    r = _create(client, team, [WANDB, MLFLOW])
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "integrations[1].type", err
    assert "'mlflow' is not allowed" in err["message"] and "'wandb'" in err["message"], err
    assert _jobs(app, team) == []
    assert _create(client, team, [WANDB]).status_code == 200


def test_allowed_integrations_setting_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZENFLOW_ALLOWED_INTEGRATIONS", "wandb, mlflow")
    assert Settings(_env_file=None).allowed_integrations == ["wandb", "mlflow"]  # type: ignore[call-arg]
    monkeypatch.setenv("ZENFLOW_ALLOWED_INTEGRATIONS", "")
    assert Settings(_env_file=None).allowed_integrations == []  # type: ignore[call-arg]
    monkeypatch.setenv("ZENFLOW_MLFLOW_TEAM_TRACKING_URIS", '{"team-a": "http://a:5000"}')
    monkeypatch.setenv("ZENFLOW_MLFLOW_TRACKING_URI", "http://all:5000")
    s = Settings(_env_file=None)  # type: ignore[call-arg]
    assert s.mlflow_uri_for("team-a") == "http://a:5000" and s.mlflow_uri_for("team-b") == "http://all:5000"


def test_the_openai_sdk_sends_and_reads_integrations(app: FastAPI, client: TestClient, team: TeamKey) -> None:
    import openai

    fid = uploaded_id(client, team)
    with ServerThread(app) as server:
        sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=team.key, max_retries=0, timeout=30)
        job = sdk.fine_tuning.jobs.create(
            model="tiny-llama",
            training_file=fid,
            integrations=[{"type": "wandb", "wandb": {"project": "p1", "tags": ["x"]}}],
        )
        (wb,) = job.integrations or []
        assert wb.type == "wandb" and wb.wandb.project == "p1" and wb.wandb.tags == ["x"]
        with pytest.raises(openai.BadRequestError) as bad:
            sdk.fine_tuning.jobs.create(
                model="tiny-llama",
                training_file=fid,
                integrations=[{"type": "comet", "comet": {}}],  # type: ignore[list-item, typeddict-item]
            )
        assert bad.value.status_code == 400 and "'comet'" in str(bad.value.body)

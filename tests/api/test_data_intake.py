"""Data checked with the job's model: at ``POST /v1/fine_tuning/jobs`` every example is rendered with
the model's chat template (a Gemma-2 style template refusing the system role is a 400 naming the file
and the line, nothing written; ``system_message: "fold"`` passes), and at ``POST /v1/files`` when the
upload names a ``model`` (refusals name the lines; truncated and dropped examples come back counted,
with their lines)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from store.orm import File, FineTuningJob
from store.settings import Settings
from tests.api.conftest import TEST_API_SETTINGS, Enqueued, TeamKey, error_of, make_team
from tests.model_folders import TOOL_CALL_RECORD, write_model_folder

JOBS = "/v1/fine_tuning/jobs"

SYSTEM_CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
}
PLAIN_CHAT = {"messages": SYSTEM_CHAT["messages"][1:]}


@pytest.fixture(scope="module")
def intake(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> tuple[FastAPI, Enqueued]:
    from api.app import create_app

    roots = tmp_path_factory.mktemp("roots")
    write_model_folder(roots / "gemma2-tiny", "gemma2")
    write_model_folder(roots / "qwen2-tiny", "qwen2", max_position_embeddings=1024)
    enqueued = Enqueued()
    return create_app(
        settings.model_copy(update={"model_roots": [roots]}), TEST_API_SETTINGS, enqueue=enqueued
    ), enqueued


@pytest.fixture(scope="module")
def iclient(intake: tuple[FastAPI, Enqueued]) -> Any:
    with TestClient(intake[0]) as c:
        yield c


@pytest.fixture
def iteam(intake: tuple[FastAPI, Enqueued]) -> TeamKey:
    return make_team(intake[0])


def _upload(client: TestClient, team: TeamKey, records: list[Any], **fields: str) -> Any:
    body = "".join(json.dumps(r) + "\n" for r in records).encode()
    return client.post(
        "/v1/files",
        headers=team.headers,
        data={"purpose": "fine-tune", **fields},
        files={"file": ("train.jsonl", body, "application/jsonl")},
    )


def _count(app: FastAPI, team: TeamKey, table: Any) -> int:
    with app.state.sessionmaker() as s:
        return int(s.scalar(select(func.count()).select_from(table).where(table.team_id == team.id)) or 0)


def test_template_refusal_is_a_400_at_create_naming_the_line(
    iclient: TestClient, intake: tuple[FastAPI, Enqueued], iteam: TeamKey
) -> None:
    app, enqueued = intake
    r = _upload(iclient, iteam, [PLAIN_CHAT, SYSTEM_CHAT])  # no model named: format only, accepted
    assert r.status_code == 200, r.text
    fid, calls = r.json()["id"], len(enqueued.calls)
    r = iclient.post(JOBS, headers=iteam.headers, json={"model": "gemma2-tiny", "training_file": fid})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert (err["param"], err["code"]) == ("training_file", "invalid_training_file")
    assert "line 2: messages[0]: " in err["message"] and "System role not supported" in err["message"]
    assert 'system_message to "fold"' in err["message"]
    assert err["errors"][0]["line"] == 2
    assert _count(app, iteam, FineTuningJob) == 0 and len(enqueued.calls) == calls

    r = iclient.post(
        JOBS,
        headers=iteam.headers,
        json={"model": "gemma2-tiny", "training_file": fid, "hyperparameters": {"system_message": "fold"}},
    )
    assert r.status_code == 200, r.text
    hp = r.json()["hyperparameters"]  # the data options are part of what the job resolves to
    assert (hp["system_message"], hp["truncation"]) == ("fold", "truncate")
    r = iclient.post(
        JOBS,
        headers=iteam.headers,
        json={
            "model": "gemma2-tiny",
            "training_file": fid,
            "validation_file": fid,
            "hyperparameters": {"system_message": "merge"},
        },
    )
    assert r.status_code == 400 and error_of(r)["param"] == "hyperparameters.system_message"


def test_upload_with_a_model_checks_every_line(
    iclient: TestClient, intake: tuple[FastAPI, Enqueued], iteam: TeamKey
) -> None:
    app = intake[0]
    r = _upload(iclient, iteam, [PLAIN_CHAT, SYSTEM_CHAT, SYSTEM_CHAT], model="gemma2-tiny")
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert (err["param"], err["code"]) == ("file", "invalid_file_format")
    assert [e["line"] for e in err["errors"]] == [2, 3]
    assert _count(app, iteam, File) == 0

    r = _upload(iclient, iteam, [PLAIN_CHAT, SYSTEM_CHAT], model="gemma2-tiny", system_message="fold")
    assert r.status_code == 200 and r.json()["validation"]["num_examples"] == 2

    long_answer = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * 600}]
    }
    long_prompt = {
        "messages": [{"role": "user", "content": "q" * 600}, {"role": "assistant", "content": "a"}]
    }
    records = [TOOL_CALL_RECORD, long_answer, PLAIN_CHAT, long_prompt]
    r = _upload(iclient, iteam, records, model="qwen2-tiny", max_seq_length="480")
    assert r.status_code == 200, r.text
    v = r.json()["validation"]
    assert v["model"] == "qwen2-tiny" and (v["max_seq_length"], v["truncation"]) == (480, "truncate")
    assert (v["num_truncated"], v["truncated_lines"], v["num_dropped"], v["dropped_lines"]) == (
        1,
        [2],
        1,
        [4],
    )
    assert r.json()["num_examples"] == 4 and "1 dropped" in v["summary"]
    assert iclient.get(f"/v1/files/{r.json()['id']}", headers=iteam.headers).json().get("validation") is None

    r = _upload(iclient, iteam, records, model="qwen2-tiny", max_seq_length="480", truncation="error")
    assert r.status_code == 400 and [e["line"] for e in error_of(r)["errors"]] == [2, 4]


def test_upload_options_are_checked(iclient: TestClient, iteam: TeamKey) -> None:
    r = _upload(iclient, iteam, [PLAIN_CHAT], truncation="drop")
    assert r.status_code == 400 and error_of(r)["param"] == "truncation"
    r = _upload(iclient, iteam, [PLAIN_CHAT], max_seq_length="512")
    assert r.status_code == 400 and error_of(r)["param"] == "max_seq_length"
    # and the schema says so (OpenAPI 3.1: JSON Schema's dependentRequired), so no client is surprised
    upload = iclient.get("/openapi.json").json()["paths"]["/v1/files"]["post"]["requestBody"]
    form = upload["content"]["multipart/form-data"]["schema"]
    assert form["dependentRequired"] == {
        k: ["model"] for k in ("max_seq_length", "truncation", "system_message")
    }
    r = _upload(iclient, iteam, [PLAIN_CHAT], model="qwen2-tiny", truncation="cut")
    assert r.status_code == 400 and error_of(r)["param"] == "truncation"
    r = _upload(iclient, iteam, [PLAIN_CHAT], model="no-such-model")
    assert r.status_code == 404 and error_of(r)["param"] == "model"
    r = _upload(iclient, iteam, [PLAIN_CHAT])  # a plain OpenAI upload: no validation object
    assert r.status_code == 200 and r.json().get("validation") is None

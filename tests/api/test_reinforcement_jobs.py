"""``POST /v1/fine_tuning/jobs`` with ``method.type: "reinforcement"`` (OpenAI's shape): the grader checked
at create (a 400 naming its param, nothing written), the item fields its templates read found in the
rows, and the job object showing the method back with its grader and resolved hyperparameters; a model
grader's model resolved for the team and recorded for the workers' judge (contract.serving.JudgeModels)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from contract.job import JobRequest
from contract.serving import ServedModel
from store.orm import FineTuningJob
from tests.api.conftest import Enqueued, TeamKey, error_of, uploaded_id
from tests.api.test_jobs import _job_rows, create
from trainer.samples import KEYWORD_GRADER

ROWS = [
    {"messages": [{"role": "user", "content": f"Use the word '{w}'."}], "keyword": w}
    for w in ("file", "value", "object", "return")
]


@pytest.fixture
def prompts(client: TestClient, team: TeamKey) -> str:
    return uploaded_id(client, team, "".join(json.dumps(r) + "\n" for r in ROWS).encode())


def _body(fid: str, grader: dict[str, Any], **hp: Any) -> dict[str, Any]:
    return {
        "model": "tiny-llama",
        "training_file": fid,
        "method": {"type": "reinforcement", "reinforcement": {"grader": grader, "hyperparameters": hp}},
    }


def test_reinforcement_job_shows_its_grader_and_resolved_settings(
    client: TestClient, team: TeamKey, prompts: str, enqueued: Enqueued
) -> None:
    r = create(
        client, team, _body(prompts, KEYWORD_GRADER, batch_size=2, compute_multiplier=0.5, eval_interval=3)
    )
    assert r.status_code == 200, r.text
    method = r.json()["method"]
    assert method["type"] == "reinforcement" and set(method) == {"type", "reinforcement"}
    assert method["reinforcement"]["grader"] == KEYWORD_GRADER
    hp = method["reinforcement"]["hyperparameters"]
    assert hp["batch_size"] == 2 and hp["compute_multiplier"] == 0.5 and hp["samples_per_prompt"] == 4
    assert hp["eval_interval"] == 3 and hp["eval_samples"] == 4 and hp["kl_beta"] == 0.0
    assert hp["reasoning_effort"] == "default" and hp["max_completion_tokens"] >= 1


@pytest.mark.parametrize(
    ("grader", "param"),
    [
        ({**KEYWORD_GRADER, "reference": "{{item.answer}}"}, "method.reinforcement.grader.reference"),
        ({**KEYWORD_GRADER, "input": "{{sample.output_text"}, "method.reinforcement.grader.input"),
        (
            {"type": "multi", "name": "m", "graders": {"a": KEYWORD_GRADER}, "calculate_output": "a +"},
            "method.reinforcement.grader.calculate_output",
        ),
        (
            {
                "type": "score_model",
                "name": "judge",
                "model": "tiny-llama",
                "input": [{"role": "user", "content": "Score {{sample.output_text}}"}],
            },
            "method.reinforcement.grader.model",
        ),
        ({**KEYWORD_GRADER, "operation": "regex"}, "method.reinforcement.grader.operation"),
    ],
)
def test_a_bad_grader_is_400_naming_its_param_and_writes_nothing(
    client: TestClient,
    app: Any,
    team: TeamKey,
    prompts: str,
    enqueued: Enqueued,
    grader: dict[str, Any],
    param: str,
) -> None:
    before, calls = _job_rows(app, team), len(enqueued.calls)
    r = create(client, team, _body(prompts, grader))
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == param, r.json()
    assert _job_rows(app, team) == before and len(enqueued.calls) == calls


def test_kl_penalty_without_lora_is_refused(client: TestClient, team: TeamKey, prompts: str) -> None:
    r = create(client, team, _body(prompts, KEYWORD_GRADER, kl_beta=0.1))
    assert r.status_code == 400 and "LoRA" in error_of(r)["message"], r.text


def test_chat_data_in_a_reinforcement_job_is_refused_by_line(client: TestClient, team: TeamKey) -> None:
    r = create(client, team, _body(uploaded_id(client, team), KEYWORD_GRADER))
    assert r.status_code == 400, r.text
    message = error_of(r)["message"]
    assert "line 1: messages[2].role: the prompt ends with an assistant message" in message, message


def test_a_prompt_with_no_room_for_its_completion_is_named_at_create(
    client: TestClient, team: TeamKey
) -> None:
    """max_seq_length 128 less max_completion_tokens 64 leaves a prompt 64 tokens; a longer one is a 400
    naming its line and both numbers (truncation "error"), never a row longer than max_seq_length."""
    long = {"messages": [{"role": "user", "content": "word " * 60}], "keyword": "file"}
    fid = uploaded_id(client, team, "".join(json.dumps(r) + "\n" for r in [*ROWS, long]).encode())
    body = _body(fid, KEYWORD_GRADER, max_seq_length=128, max_completion_tokens=64, truncation="error")
    r = create(client, team, body)
    assert r.status_code == 400, r.text
    message = error_of(r)["message"]
    assert "line 5" in message and "max_seq_length 128 less the 64 of its completion" in message, message
    assert (
        create(
            client, team, _body(fid, KEYWORD_GRADER, max_seq_length=512, max_completion_tokens=64)
        ).status_code
        == 200
    )


def _judged(model: str) -> dict[str, Any]:
    return {
        "type": "multi",
        "name": "m",
        "graders": {
            "keyword": KEYWORD_GRADER,
            "judge": {
                "type": "score_model",
                "name": "judge",
                "model": model,
                "input": [{"role": "user", "content": "Score {{sample.output_text}} for {{item.keyword}}"}],
                "range": [0, 1],
            },
        },
        "calculate_output": "0.5 * keyword + 0.5 * judge",
    }


@pytest.fixture
def with_serving(client: TestClient, app: Any) -> Iterator[None]:
    """The API (started) configured with a serving process (create only records what its workers ask)."""
    before = app.state.api_settings
    app.state.api_settings = before.model_copy(update={"inference_server_url": "http://serving.invalid:8001"})
    try:
        yield
    finally:
        app.state.api_settings = before


def test_model_graders_are_resolved_for_the_team_at_create(
    client: TestClient, app: Any, team: TeamKey, prompts: str, enqueued: Enqueued, with_serving: None
) -> None:
    r = create(client, team, _body(prompts, _judged("tiny-llama")))
    assert r.status_code == 200, r.text
    assert r.json()["method"]["reinforcement"]["grader"] == _judged("tiny-llama")
    assert "judges" not in json.dumps(r.json())  # the server's own record, not the job object's
    with app.state.sessionmaker() as s:
        request = s.get(FineTuningJob, r.json()["id"]).request
    judges = JobRequest.model_validate(request).method.judges  # type: ignore[union-attr]
    assert judges is not None and judges.team == team.id
    assert judges.models == {"tiny-llama": ServedModel(id="tiny-llama", source="tiny-llama")}


def test_a_judge_model_the_team_may_not_use_is_404_naming_it(
    client: TestClient, app: Any, team: TeamKey, prompts: str, enqueued: Enqueued, with_serving: None
) -> None:
    before = _job_rows(app, team)
    r = create(client, team, _body(prompts, _judged("ft:tiny-llama:another-team:abc123")))
    assert r.status_code == 404, r.text
    assert error_of(r)["param"] == "method.reinforcement.grader.graders.judge.model", r.json()
    assert _job_rows(app, team) == before


def test_model_graders_without_a_serving_process_are_400_naming_the_model(
    client: TestClient, team: TeamKey, prompts: str
) -> None:
    r = create(client, team, _body(prompts, _judged("tiny-llama")))
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "method.reinforcement.grader.graders.judge.model"
    assert "serving process" in err["message"] and "INFERENCE_SERVER_URL" in err["message"], err

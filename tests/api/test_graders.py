"""The grader endpoints through the official openai SDK against uvicorn: ``client.fine_tuning.alpha.graders``
``validate`` and ``run`` (string_check scores a right and a wrong sample 1 and 0, a multi grader's
sub_rewards, a bad formula's 400 naming ``grader.calculate_output``), a model grader judged by a served
built-in model answers 200 with its flags whatever the model says, another team's ``ft:`` model is 404; a
Python grader runs under the server's sandbox limits (``python_grader_wall_seconds``); cosine runs where the
settings name an embedding model (``grader_embedding_model``) and is a 400 elsewhere."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi import FastAPI

from store.settings import Settings
from tests.api.chat_support import register_fine_tuned, write_model_folder
from tests.api.conftest import TEST_API_SETTINGS, Enqueued, ServerThread, TeamKey, make_team

EXACT: dict[str, Any] = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
JUDGE: dict[str, Any] = {
    "type": "score_model",
    "name": "judge",
    "model": "tiny-llama",
    "input": [
        {"role": "system", "content": "Grade the answer from 0 to 1."},
        {"role": "user", "content": [{"type": "input_text", "text": "Q: 2+2? A: {{sample.output_text}}"}]},
    ],
    "range": [0, 1],
    "sampling_params": {"max_completions_tokens": 8, "temperature": 0, "seed": 1},
}


@pytest.fixture(scope="module")
def graders_app(settings: Settings) -> FastAPI:
    from api.app import create_app

    return create_app(settings, TEST_API_SETTINGS, enqueue=Enqueued())


@pytest.fixture(scope="module")
def server(graders_app: FastAPI) -> Iterator[ServerThread]:
    with ServerThread(graders_app) as s:
        yield s


def _sdk(server: ServerThread, team: TeamKey) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=team.key, max_retries=0, timeout=120)


@pytest.fixture
def client(server: ServerThread, graders_app: FastAPI) -> openai.OpenAI:
    return _sdk(server, make_team(graders_app))


def test_string_check_scores_a_right_and_a_wrong_sample_1_and_0(client: openai.OpenAI) -> None:
    assert client.fine_tuning.alpha.graders.validate(grader=EXACT).grader is not None  # type: ignore[arg-type]
    right = client.fine_tuning.alpha.graders.run(grader=EXACT, model_sample="4", item={"answer": "4"})  # type: ignore[arg-type]
    wrong = client.fine_tuning.alpha.graders.run(grader=EXACT, model_sample="5", item={"answer": "4"})  # type: ignore[arg-type]
    assert (right.reward, wrong.reward) == (1.0, 0.0)
    assert right.metadata.name == "exact" and right.metadata.type == "string_check"
    assert right.metadata.errors.invalid_variable_error is False and right.metadata.execution_time >= 0
    assert right.sub_rewards == {} and right.api_model_grader_token_usage_per_model == {}


def test_a_missing_item_field_is_a_flag_not_an_error(client: openai.OpenAI) -> None:
    r = client.fine_tuning.alpha.graders.run(grader=EXACT, model_sample="4", item={"other": 1})  # type: ignore[arg-type]
    assert r.reward == 0.0 and r.metadata.errors.invalid_variable_error is True


def test_validate_echoes_the_grader_and_refuses_a_bad_formula(client: openai.OpenAI) -> None:
    multi = {"type": "multi", "name": "m", "graders": {"exact": EXACT}, "calculate_output": "exact * 2"}
    assert client.fine_tuning.alpha.graders.validate(grader=multi).to_dict()["grader"] == multi  # type: ignore[arg-type]
    for formula in ("__import__('os').system('true')", "exact.real", "exact +", "nope * 2"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.fine_tuning.alpha.graders.validate(grader={**multi, "calculate_output": formula})  # type: ignore[arg-type]
        assert caught.value.param == "grader.calculate_output", formula  # type: ignore[attr-defined]


def test_a_bad_field_is_a_400_naming_it(client: openai.OpenAI) -> None:
    bad = {
        "type": "multi",
        "name": "m",
        "graders": {"exact": {**EXACT, "operation": "regex"}},
        "calculate_output": "exact",
    }
    with pytest.raises(openai.BadRequestError) as caught:
        client.fine_tuning.alpha.graders.validate(grader=bad)  # type: ignore[arg-type]
    assert caught.value.param == "grader.graders.exact.operation"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as caught:
        client.fine_tuning.alpha.graders.run(grader={**EXACT, "reference": "{{item.answer"}, model_sample="4")  # type: ignore[arg-type]
    assert caught.value.param == "grader.reference"  # type: ignore[attr-defined]


def test_a_multi_grader_reports_its_sub_rewards(client: openai.OpenAI) -> None:
    close = {**EXACT, "type": "text_similarity", "name": "close", "evaluation_metric": "fuzzy_match"}
    del close["operation"]
    multi = {
        "type": "multi",
        "name": "both",
        "graders": {"exact": EXACT, "close": close},
        "calculate_output": "0.5 * exact + 0.5 * close",
    }
    r = client.fine_tuning.alpha.graders.run(grader=multi, model_sample="Paris", item={"answer": "Paris"})  # type: ignore[arg-type]
    assert r.sub_rewards == {"exact": 1.0, "close": 1.0} and r.reward == pytest.approx(1.0)
    r = client.fine_tuning.alpha.graders.run(grader=multi, model_sample="Pari", item={"answer": "Paris"})  # type: ignore[arg-type]
    assert r.sub_rewards["exact"] == 0.0 and 0.8 < r.sub_rewards["close"] < 1  # type: ignore[operator]
    assert r.reward == pytest.approx(0.5 * r.sub_rewards["close"])  # type: ignore[operator]


def test_a_model_grader_on_a_served_model_answers_200_with_its_flags(client: openai.OpenAI) -> None:
    """tiny-llama (random weights) cannot judge: whatever it writes, the run is a 200 with a score in range
    or the parse flag, and the tokens it used."""
    r = client.fine_tuning.alpha.graders.run(grader=JUDGE, model_sample="4", item={})  # type: ignore[arg-type]
    errors = r.metadata.errors
    assert errors.api_model_grader_server_error is False, errors.api_model_grader_server_error_details
    assert errors.api_model_grader_parse_error or 0.0 <= r.reward <= 1.0
    assert r.metadata.sampled_model_name == "tiny-llama" and (r.metadata.token_usage or 0) > 0
    assert "tiny-llama" in r.api_model_grader_token_usage_per_model


def test_another_teams_fine_tuned_model_cannot_judge(
    server: ServerThread, graders_app: FastAPI, tmp_path: Path
) -> None:
    owner, stranger = make_team(graders_app), make_team(graders_app)
    ft = register_fine_tuned(graders_app, owner, write_model_folder(tmp_path / "final", seed=3))
    multi = {
        "type": "multi",
        "name": "m",
        "graders": {"judge": {**JUDGE, "model": ft}},
        "calculate_output": "judge",
    }
    for call in (
        lambda c: c.fine_tuning.alpha.graders.validate(grader={**JUDGE, "model": ft}),
        lambda c: c.fine_tuning.alpha.graders.run(grader=multi, model_sample="4"),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            call(_sdk(server, stranger))
        assert caught.value.param in ("grader.model", "grader.graders.judge.model")  # type: ignore[attr-defined]
    assert (
        _sdk(server, owner).fine_tuning.alpha.graders.validate(grader={**JUDGE, "model": ft}).grader
        is not None
    )  # type: ignore[arg-type]


SLEEPER = {
    "type": "python",
    "name": "sleeps",
    "source": "import time\n\ndef grade(sample, item):\n    time.sleep(60)\n    return 1.0\n",
}


@pytest.fixture(scope="module")
def limited_server(settings: Settings) -> Iterator[tuple[ServerThread, FastAPI]]:
    """An API whose settings give a Python grader 2 s of wall clock (ZENFLOW_PYTHON_GRADER_WALL_SECONDS)."""
    from api.app import create_app

    app = create_app(
        settings.model_copy(update={"python_grader_wall_seconds": 2.0}), TEST_API_SETTINGS, enqueue=Enqueued()
    )
    with ServerThread(app) as s:
        yield s, app


def test_a_python_grader_runs_under_the_servers_wall_clock(
    limited_server: tuple[ServerThread, FastAPI],
) -> None:
    from trainer.graders.sandbox import run_python_grader

    if run_python_grader("def grade(sample, item):\n    return 1\n", {}, {}).error == "server":
        pytest.skip("no sandbox on this host")
    server, app = limited_server
    sdk = _sdk(server, make_team(app))
    t0 = time.monotonic()
    r = sdk.fine_tuning.alpha.graders.run(grader=SLEEPER, model_sample="4", item={})  # type: ignore[arg-type]
    took = time.monotonic() - t0
    assert r.reward == 0.0 and r.metadata.errors.python_grader_runtime_error is True
    assert r.metadata.errors.python_grader_runtime_error_details == "timed out after 2 s (wall)"
    # the source's check and the 2 s call, each with an interpreter's start on a loaded box
    assert took < 2 * 2.0 + 10


COSINE: dict[str, Any] = {**EXACT, "type": "text_similarity", "name": "close", "evaluation_metric": "cosine"}
del COSINE["operation"]


@pytest.fixture(scope="module")
def embedding_server(settings: Settings) -> Iterator[tuple[ServerThread, FastAPI]]:
    """An API whose settings name an embedding model (ZENFLOW_GRADER_EMBEDDING_MODEL: the demo base)."""
    from api.app import create_app
    from trainer.samples import MODELS_DIR

    folder = str(MODELS_DIR / "docs-llama")
    app = create_app(
        settings.model_copy(update={"grader_embedding_model": folder}), TEST_API_SETTINGS, enqueue=Enqueued()
    )
    with ServerThread(app) as s:
        yield s, app


def test_cosine_runs_where_an_embedding_model_is_configured_and_is_refused_elsewhere(
    client: openai.OpenAI, embedding_server: tuple[ServerThread, FastAPI]
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.fine_tuning.alpha.graders.validate(grader=COSINE)  # type: ignore[arg-type]
    assert caught.value.param == "grader.evaluation_metric"  # type: ignore[attr-defined]
    server, app = embedding_server
    sdk = _sdk(server, make_team(app))
    assert sdk.fine_tuning.alpha.graders.validate(grader=COSINE).grader is not None  # type: ignore[arg-type]
    text = "The capital of Japan is Tokyo."
    same = sdk.fine_tuning.alpha.graders.run(grader=COSINE, model_sample=text, item={"answer": text})  # type: ignore[arg-type]
    other = sdk.fine_tuning.alpha.graders.run(
        grader=COSINE, model_sample="def f(): pass", item={"answer": text}
    )  # type: ignore[arg-type]
    assert same.reward == pytest.approx(1.0, abs=1e-5) and not same.metadata.errors.other_error
    assert other.reward < same.reward

"""The model graders' judge in a training job (trainer.graders.serving_judge): a real serving process
(``python -m serving``) judges a score_model grader on tiny-llama for the job's team (its reply, usage
and model come back; the process counts the call); a wrong token, an unreachable process and a model the
job was not resolved for each give reward 0 with ``model_grader_server_error`` and the reason; a 429 is
retried after its ``Retry-After`` a bounded number of times (served by an httpx transport: a real
serving process cannot be made to answer 429 on cue)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from contract.graders import ScoreModelGrader
from contract.serving import JudgeModels, ServedModel
from tests.api.conftest import free_port
from tests.serving.test_serving_process import TOKEN, chat_requests_answered, serving_process
from trainer.graders import serving_judge
from trainer.graders.grade import grade
from trainer.graders.model_graders import JudgeError
from trainer.graders.result import Sample
from trainer.graders.serving_judge import RETRIES, ServingJudge

JUDGE = ScoreModelGrader.model_validate(
    {
        "type": "score_model",
        "name": "judge",
        "model": "tiny-llama",
        "input": [{"role": "user", "content": "Rate {{sample.output_text}} for {{item.word}} from 0 to 1."}],
        "range": [0, 1],
        "sampling_params": {"max_completions_tokens": 8},
    }
)
JUDGES = JudgeModels(
    team="team-judge-test", models={"tiny-llama": ServedModel(id="tiny-llama", source="tiny-llama")}
)
ITEM = {"word": "value"}


@pytest.fixture(scope="module")
def serving() -> Iterator[str]:
    port = free_port()
    with serving_process(port):
        yield f"http://127.0.0.1:{port}"


@pytest.mark.slow
def test_the_serving_process_judges_for_the_jobs_team(serving: str) -> None:
    before = chat_requests_answered(serving)
    with ServingJudge(serving, TOKEN, JUDGES, timeout_seconds=60) as judge:
        result = grade(JUDGE, Sample.of_text("a value"), ITEM, judge=judge)
    assert not result.errors.model_grader_server_error, result.errors
    assert result.sampled_model_name == "tiny-llama" and result.token_usage and result.token_usage > 0
    assert "reply" in result.scores and 0.0 <= result.reward <= 1.0  # a random model's reply: any score
    assert chat_requests_answered(serving) == before + 1


@pytest.mark.slow
def test_a_wrong_token_is_a_server_error_with_its_status(serving: str) -> None:
    with ServingJudge(serving, "not-" + TOKEN, JUDGES, timeout_seconds=60) as judge:
        result = grade(JUDGE, Sample.of_text("a value"), ITEM, judge=judge)
    assert result.reward == 0.0 and result.errors.model_grader_server_error
    assert (result.errors.model_grader_server_error_details or "").startswith("401: "), result.errors


def test_an_unreachable_serving_process_is_a_server_error() -> None:
    with ServingJudge(f"http://127.0.0.1:{free_port()}", TOKEN, JUDGES, timeout_seconds=5) as judge:
        result = grade(JUDGE, Sample.of_text("a value"), ITEM, judge=judge)
    assert result.reward == 0.0 and result.errors.model_grader_server_error
    assert "could not be reached" in (result.errors.model_grader_server_error_details or "")


def test_a_model_not_resolved_at_create_is_never_asked_for() -> None:
    calls: list[httpx.Request] = []
    transport = httpx.MockTransport(lambda r: calls.append(r) or httpx.Response(500))
    other = JUDGE.model_copy(update={"model": "small-llama"})
    with ServingJudge("http://serving", TOKEN, JUDGES, timeout_seconds=5, transport=transport) as judge:
        result = grade(other, Sample.of_text("a value"), ITEM, judge=judge)
    assert result.errors.model_grader_server_error and not calls
    assert "was not resolved for this job" in (result.errors.model_grader_server_error_details or "")


def _completion(text: str) -> dict[str, Any]:
    return {
        "model": "tiny-llama",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }


@pytest.mark.parametrize(("busy", "ok"), [(2, True), (RETRIES + 1, False)])
def test_a_busy_serving_process_is_asked_again_a_bounded_number_of_times(
    busy: int, ok: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    waits: list[float] = []
    monkeypatch.setattr(serving_judge.time, "sleep", waits.append)
    seen: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(httpx.Response(200, content=request.content).json())
        if len(seen) <= busy:
            return httpx.Response(429, headers={"Retry-After": "3"}, json={"error": {"message": "busy"}})
        return httpx.Response(200, json=_completion('{"result": 0.75}'))

    transport = httpx.MockTransport(answer)
    with ServingJudge("http://serving", TOKEN, JUDGES, timeout_seconds=5, transport=transport) as judge:
        if ok:
            reply = judge.chat("tiny-llama", [{"role": "user", "content": "x"}], {"max_tokens": 4})
            assert reply.text == '{"result": 0.75}' and reply.token_usage["total_tokens"] == 8
        else:
            with pytest.raises(JudgeError, match=r"^429: busy"):
                judge.chat("tiny-llama", [{"role": "user", "content": "x"}], {"max_tokens": 4})
    assert len(seen) == min(busy + 1, RETRIES + 1) and waits == [3.0] * min(busy, RETRIES)
    assert seen[0] == {
        "team": JUDGES.team,
        "model": {"id": "tiny-llama", "source": "tiny-llama", "adapter_path": None},
        "request": {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4},
    }

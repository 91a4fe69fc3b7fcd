from __future__ import annotations

from typing import Any

import pytest

from contract.graders import LabelModelGrader, ScoreModelGrader
from trainer.graders.grade import grade
from trainer.graders.model_graders import JudgeError, JudgeReply, parse_label, parse_score
from trainer.graders.result import Sample
from trainer.graders.validate import grader_errors

SCORE = {
    "type": "score_model",
    "name": "judge",
    "model": "judge-model",
    "input": [{"role": "user", "content": "Rate {{sample.output_text}} against {{item.answer}}"}],
    "range": [0, 10],
    "sampling_params": {"temperature": 0.5, "max_completions_tokens": 16},
}
LABEL = {
    "type": "label_model",
    "name": "polite",
    "model": "judge-model",
    "input": [{"role": "user", "content": "Is {{sample.output_text}} polite?"}],
    "labels": ["yes", "no"],
    "passing_labels": ["yes"],
}


class FakeJudge:
    def __init__(self, text: str = "", *, error: str | None = None, refusal: str | None = None) -> None:
        self.text, self.error, self.refusal = text, error, refusal
        self.calls: list[tuple[str, list[dict[str, Any]], dict[str, Any]]] = []

    def chat(self, model: str, messages: list[dict[str, Any]], sampling: dict[str, Any]) -> JudgeReply:
        self.calls.append((model, messages, sampling))
        if self.error:
            raise JudgeError(self.error)
        usage = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
        return JudgeReply(self.text, model, usage, self.refusal)


def _score(judge: FakeJudge) -> Any:
    return grade(
        ScoreModelGrader.model_validate(SCORE), Sample.of_text("Paris"), {"answer": "Paris"}, judge=judge
    )


def test_parse_score() -> None:
    assert parse_score('{"result": 7, "steps": []}') == 7.0
    assert parse_score('Sure! {"score": 0.5}') == 0.5
    assert parse_score("I'd say 8/10") == 8.0
    assert parse_score('{"result": "6"}') == 6.0
    assert parse_score("no idea") is None


def test_parse_label() -> None:
    assert parse_label('{"result": "Yes"}', ["yes", "no"]) == "yes"
    assert parse_label("no.", ["yes", "no"]) == "no"
    assert parse_label("I think the answer is no, not yes", ["yes", "no"]) == "no"
    assert parse_label("maybe", ["yes", "no"]) is None


def test_a_score_in_range_is_the_reward_with_usage() -> None:
    judge = FakeJudge('{"result": 7}')
    result = _score(judge)
    assert result.reward == 7.0 and not result.errors.any()
    assert result.token_usage == 12 and result.usage_per_model == {
        "judge-model": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    }
    model, messages, sampling = judge.calls[0]
    assert model == "judge-model" and messages[0]["content"] == "Rate Paris against Paris"
    assert "0 to 10" in messages[-1]["content"] and sampling == {"temperature": 0.5, "max_tokens": 16}


def test_out_of_range_is_clamped_and_said() -> None:
    result = _score(FakeJudge('{"result": 42}'))
    assert result.reward == 10.0 and result.scores["clamped"] and result.scores["score"] == 42.0


@pytest.mark.parametrize(
    ("judge", "flag"),
    [
        (FakeJudge("no number here"), "model_grader_parse_error"),
        (FakeJudge(refusal="I can't help with that"), "model_grader_refusal_error"),
        (FakeJudge(error="503: model unavailable"), "model_grader_server_error"),
    ],
)
def test_failures_are_flags(judge: FakeJudge, flag: str) -> None:
    result = _score(judge)
    assert result.reward == 0.0 and getattr(result.errors, flag) is True
    if flag == "model_grader_server_error":
        assert result.errors.model_grader_server_error_details == "503: model unavailable"


def test_no_judge_is_a_server_error_not_an_exception() -> None:
    result = grade(ScoreModelGrader.model_validate(SCORE), Sample.of_text("x"), {"answer": "y"})
    assert result.errors.model_grader_server_error and result.reward == 0.0


def test_label_model() -> None:
    grader = LabelModelGrader.model_validate(LABEL)
    assert grade(grader, Sample.of_text("please"), {}, judge=FakeJudge('{"result": "yes"}')).reward == 1.0
    assert grade(grader, Sample.of_text("go away"), {}, judge=FakeJudge("no")).reward == 0.0
    assert grade(grader, Sample.of_text("x"), {}, judge=FakeJudge("perhaps")).errors.model_grader_parse_error


def test_validation_refuses_a_model_the_team_cannot_use() -> None:
    grader = ScoreModelGrader.model_validate(SCORE)
    assert grader_errors(grader, judge_models=lambda m: m == "judge-model") == []
    assert grader_errors(grader, judge_models=lambda m: False)[0][0] == "grader.model"


def test_python_graders_run_in_the_sandbox() -> None:
    pytest.importorskip("trainer.graders.python")
    from contract.graders import PythonGrader

    grader = PythonGrader.model_validate(
        {
            "type": "python",
            "name": "p",
            "source": "def grade(sample, item):\n    return 1.0 if sample['output_text'] == item['answer'] else 0.0\n",
        }
    )
    assert grade(grader, Sample.of_text("4"), {"answer": "4"}).reward == 1.0

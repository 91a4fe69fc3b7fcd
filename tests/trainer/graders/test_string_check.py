from __future__ import annotations

import pytest

from contract.graders import StringCheckGrader
from trainer.graders.grade import grade
from trainer.graders.result import Sample


def _grader(operation: str) -> StringCheckGrader:
    return StringCheckGrader.model_validate(
        {
            "type": "string_check",
            "name": "s",
            "input": "{{sample.output_text}}",
            "reference": "{{item.ref}}",
            "operation": operation,
        }
    )


@pytest.mark.parametrize(
    ("operation", "text", "ref", "reward"),
    [
        ("eq", "Paris", "Paris", 1.0),
        ("eq", "paris", "Paris", 0.0),
        ("ne", "Rome", "Paris", 1.0),
        ("ne", "Paris", "Paris", 0.0),
        ("like", "It is Paris.", "Paris", 1.0),
        ("like", "It is paris.", "Paris", 0.0),
        ("ilike", "It is PARIS.", "paris", 1.0),
        ("ilike", "It is Rome.", "paris", 0.0),
    ],
)
def test_operations(operation: str, text: str, ref: str, reward: float) -> None:
    result = grade(_grader(operation), Sample.of_text(text), {"ref": ref})
    assert result.reward == reward and not result.errors.any() and result.execution_time >= 0


def test_a_missing_field_is_flagged() -> None:
    result = grade(_grader("eq"), Sample.of_text("x"), {})
    assert result.reward == 0.0 and result.errors.invalid_variable_error and "ref" in result.scores["error"]

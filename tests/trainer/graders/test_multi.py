from __future__ import annotations

import pytest

from contract.graders import MultiGrader
from trainer.graders.grade import grade
from trainer.graders.multi import FormulaError, evaluate, formula_errors, parse
from trainer.graders.result import Sample
from trainer.graders.validate import grader_errors


def test_formulas_evaluate() -> None:
    values = {"a": 1.0, "b": 0.25}
    assert evaluate(parse("0.5 * a + 0.5 * b"), values) == pytest.approx(0.625)
    assert evaluate(parse("-(a - b) ** 2 / 2"), values) == pytest.approx(-0.28125)
    assert evaluate(
        parse("min(a, b) + max(a, b) + abs(-b) + floor(1.5) + ceil(0.2) + sqrt(4) + exp(0) + log(1)"), values
    ) == pytest.approx(6.5)


@pytest.mark.parametrize(
    "formula",
    [
        "__import__('os')",
        "a.real",
        "a[0]",
        "open('x')",
        "eval('1')",
        "(lambda: 1)()",
        "a if b else 1",
        "'x'",
        "a < b",
        "max(*[a])",
        "a % 2",
        "round(a)",
        "a +",
    ],
)
def test_anything_outside_the_whitelist_is_refused(formula: str) -> None:
    with pytest.raises(FormulaError):
        parse(formula)
    assert formula_errors(formula, {"a", "b"})


def test_unknown_names_and_failures_at_grade_time() -> None:
    assert "c is not a grader" in formula_errors("a + c", {"a", "b"})[0]
    for formula in ("a / 0", "10 ** 10 ** 10", "exp(1000)", "log(0)", "sqrt(-1)", "(-8) ** 0.5"):
        with pytest.raises(FormulaError):
            evaluate(parse(formula), {"a": 1.0})
    with pytest.raises(FormulaError):
        parse("(" * 500 + "1" + ")" * 500)


def _multi(formula: str) -> MultiGrader:
    check = {"type": "string_check", "name": "x", "input": "{{sample.output_text}}", "operation": "eq"}
    return MultiGrader.model_validate(
        {
            "type": "multi",
            "name": "m",
            "calculate_output": formula,
            "graders": {
                "right": {**check, "reference": "{{item.answer}}"},
                "missing": {**check, "reference": "{{item.nope}}"},
            },
        }
    )


def test_a_multi_grader_combines_and_merges_flags() -> None:
    result = grade(_multi("right * 0.75 + missing"), Sample.of_text("4"), {"answer": "4"})
    assert result.sub_rewards == {"right": 1.0, "missing": 0.0}
    assert result.reward == 0.75 and result.errors.invalid_variable_error and result.type == "multi"
    failed = grade(_multi("right / missing"), Sample.of_text("4"), {"answer": "4"})
    assert failed.reward == 0.0 and failed.errors.other_error and "division" in failed.scores["error"]


def test_validation_names_the_formula() -> None:
    assert grader_errors(_multi("right + missing")) == []
    problems = grader_errors(_multi("right.__class__"))
    assert problems and problems[0][0] == "grader.calculate_output"

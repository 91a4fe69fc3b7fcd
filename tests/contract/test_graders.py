"""contract.graders: OpenAI's grader shapes accepted as the SDK builds them; bad ones refused naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.graders import (
    LabelModelGraderParam,
    MultiGraderParam,
    PythonGraderParam,
    ScoreModelGraderParam,
    StringCheckGraderParam,
    TextSimilarityGraderParam,
)
from pydantic import BaseModel, ValidationError

from contract.graders import (
    MAX_MULTI_DEPTH,
    MAX_PYTHON_SOURCE_CHARS,
    AnyGrader,
    Grader,
    LabelModelGrader,
    MultiGrader,
    ScoreModelGrader,
    StringCheckGrader,
    field_path,
    message_text,
    multi_depth,
)


class Body(BaseModel):
    grader: AnyGrader


class JobBody(BaseModel):
    grader: Grader


STRING_CHECK: StringCheckGraderParam = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
SIMILARITY: TextSimilarityGraderParam = {
    "type": "text_similarity",
    "name": "close",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "evaluation_metric": "fuzzy_match",
}
PYTHON: PythonGraderParam = {
    "type": "python",
    "name": "py",
    "source": "def grade(sample, item) -> float:\n    return 1.0\n",
    "image_tag": "2025-05-08",
}
SCORE: ScoreModelGraderParam = {
    "type": "score_model",
    "name": "judge",
    "model": "tiny-llama",
    "input": [
        {"role": "system", "content": "Score the answer from 0 to 1."},
        {
            "role": "user",
            "type": "message",
            "content": [{"type": "input_text", "text": "Answer: {{sample.output_text}}"}],
        },
    ],
    "range": [0, 1],
    "sampling_params": {"temperature": 0, "max_completions_tokens": 32, "seed": 1, "top_p": 1},
}
LABEL: LabelModelGraderParam = {
    "type": "label_model",
    "name": "label",
    "model": "tiny-llama",
    "input": [{"role": "user", "content": "Is {{sample.output_text}} polite? yes or no"}],
    "labels": ["yes", "no"],
    "passing_labels": ["yes"],
}
MULTI: dict[str, Any] = {
    "type": "multi",
    "name": "both",
    "graders": {"exact": STRING_CHECK, "close": SIMILARITY, "label": LABEL},
    "calculate_output": "0.5 * exact + 0.5 * close",
}


def refusal(grader: Any, body: type[BaseModel] = Body) -> tuple[tuple[int | str, ...], str]:
    """The first error's field path (union tags dropped) and message."""
    with pytest.raises(ValidationError) as caught:
        body.model_validate({"grader": grader})
    first = caught.value.errors()[0]
    return field_path(first["loc"]), first["msg"]


@pytest.mark.parametrize("grader", [STRING_CHECK, SIMILARITY, PYTHON, SCORE, LABEL, MULTI])
def test_the_sdk_payloads_validate_and_dump_back_alike(grader: Any) -> None:
    parsed = Body.model_validate({"grader": grader}).grader
    assert parsed.type == grader["type"]
    dumped = parsed.model_dump(mode="json", exclude_unset=True)
    assert dumped["name"] == grader["name"]
    if grader["type"] == "score_model":
        assert dumped["range"] == [0, 1]
        assert isinstance(parsed, ScoreModelGrader)
        assert message_text(parsed.input[1].content) == "Answer: {{sample.output_text}}"


def test_a_job_grader_is_openai_s_five_types_label_model_only_inside_multi() -> None:
    assert JobBody.model_validate({"grader": MULTI}).grader.type == "multi"
    path, msg = refusal(LABEL, JobBody)
    assert path == ("grader",) and "label_model" not in msg.split("expected tags:")[-1]


def test_the_sdk_single_grader_form_of_multi_is_keyed_by_its_name() -> None:
    """The SDK types ``graders`` as one grader; OpenAI's docs give a mapping: both are taken."""
    multi: MultiGraderParam = {
        "type": "multi",
        "name": "m",
        "graders": STRING_CHECK,
        "calculate_output": "exact",
    }
    parsed = Body.model_validate({"grader": multi}).grader
    assert isinstance(parsed, MultiGrader) and list(parsed.graders) == ["exact"]


def test_score_model_range_defaults_and_is_checked() -> None:
    without = {k: v for k, v in SCORE.items() if k != "range"}
    assert ScoreModelGrader.model_validate(without).range == (0.0, 1.0)
    assert ScoreModelGrader.model_validate({**without, "range": None}).range == (0.0, 1.0)
    assert refusal({**SCORE, "range": [1, 1]})[0] == ("grader", "range")
    assert refusal({**SCORE, "range": [0, 1, 2]})[0][:2] == ("grader", "range")
    assert refusal({**SCORE, "sampling_params": {"temperature": 9}})[0] == (
        "grader",
        "sampling_params",
        "temperature",
    )


@pytest.mark.parametrize(
    ("change", "path", "words"),
    [
        ({"name": "  "}, ("grader", "name"), "empty"),
        ({"operation": "regex"}, ("grader", "operation"), "'eq'"),
        ({"extra": 1}, ("grader", "extra"), "Extra"),
        ({"input": "x" * 70_000}, ("grader", "input"), "over the limit"),
    ],
)
def test_a_bad_string_check_names_its_field(
    change: dict[str, Any], path: tuple[str, ...], words: str
) -> None:
    got, msg = refusal({**STRING_CHECK, **change})
    assert got == path and words in msg


def test_labels_are_checked() -> None:
    assert refusal({**LABEL, "labels": []})[0] == ("grader", "labels")
    path, msg = refusal({**LABEL, "passing_labels": ["maybe"]})
    assert path == ("grader", "passing_labels") and "'maybe'" in msg
    assert refusal({**LABEL, "passing_labels": []})[0] == ("grader", "passing_labels")
    assert refusal({**LABEL, "labels": ["a", "a"]})[0] == ("grader", "labels")


def test_python_source_is_bounded() -> None:
    path, msg = refusal({**PYTHON, "source": "#" * (MAX_PYTHON_SOURCE_CHARS + 1)})
    assert path == ("grader", "source") and "over the limit" in msg
    assert refusal({**PYTHON, "source": " "})[0] == ("grader", "source")


@pytest.mark.parametrize(
    "part",
    [
        {"type": "input_image", "image_url": "https://x/y.png"},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
    ],
)
def test_image_and_audio_inputs_are_refused_clearly(part: dict[str, Any]) -> None:
    grader = {**SCORE, "input": [{"role": "user", "content": [part]}]}
    path, msg = refusal(grader)
    assert path == ("grader", "input", 0, "content")
    assert part["type"] in msg and "text only" in msg


def test_a_sub_grader_s_error_is_named_through_the_multi_grader() -> None:
    bad = {**MULTI, "graders": {"exact": {**STRING_CHECK, "operation": "regex"}, "multi": LABEL}}
    assert refusal(bad)[0] == ("grader", "graders", "exact", "operation")
    bad = {**MULTI, "graders": {"multi": {**LABEL, "labels": []}}}
    assert refusal(bad)[0] == ("grader", "graders", "multi", "labels")


def test_multi_keys_must_be_formula_names_and_nesting_is_bounded() -> None:
    path, msg = refusal({**MULTI, "graders": {"not a name": STRING_CHECK}})
    assert path == ("grader", "graders") and "'not a name'" in msg
    nested: dict[str, Any] = STRING_CHECK
    for _ in range(MAX_MULTI_DEPTH):
        nested = {"type": "multi", "name": "m", "graders": {"g": nested}, "calculate_output": "g"}
    assert multi_depth(Body.model_validate({"grader": nested}).grader) == MAX_MULTI_DEPTH
    deeper = {"type": "multi", "name": "m", "graders": {"g": nested}, "calculate_output": "g"}
    path, msg = refusal(deeper)
    assert path == ("grader", "graders") and "nest" in msg
    assert refusal({**MULTI, "graders": {}})[0] == ("grader", "graders")


def test_a_grader_validated_on_its_own_loses_its_tag_too() -> None:
    with pytest.raises(ValidationError) as caught:
        LabelModelGrader.model_validate({**LABEL, "labels": []})
    assert field_path(caught.value.errors()[0]["loc"]) == ("labels",)
    assert StringCheckGrader.model_validate(STRING_CHECK).operation == "eq"

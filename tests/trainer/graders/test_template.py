from __future__ import annotations

import pytest

from contract.graders import MultiGrader
from trainer.graders.result import Sample
from trainer.graders.template import TemplateError, item_fields, render, template_errors

ITEM = {"answer": "Paris", "meta": {"n": 3, "tags": ["a", "b"]}}


def test_render_reads_item_and_sample() -> None:
    sample = Sample.of_text('{"city": "Paris", "n": [1, 2]}')
    text = "{{ item.answer }}|{{item.meta.n}}|{{item.meta.tags.1}}|{{sample.output_json.city}}|{{sample.output_json.n}}"
    assert render(text, sample, ITEM) == "Paris|3|b|Paris|[1, 2]"
    assert render("{{sample.output_text}}", Sample.of_text("hi"), {}) == "hi"


@pytest.mark.parametrize(
    ("template", "flag"),
    [
        ("{{item.missing}}", "invalid_variable_error"),
        ("{{item.meta.tags.5}}", "invalid_variable_error"),
        ("{{other.x}}", "invalid_variable_error"),
        ("{{sample.output_json.city}}", "sample_parse_error"),
    ],
)
def test_what_cannot_render_carries_its_flag(template: str, flag: str) -> None:
    with pytest.raises(TemplateError) as caught:
        render(template, Sample.of_text("not json"), ITEM)
    assert caught.value.flag == flag


def test_template_errors_before_any_sample() -> None:
    assert template_errors("{{item.answer}} and {{sample.output_text}}") == []
    assert "unbalanced" in template_errors("{{item.answer")[0]
    assert "unknown namespace" in template_errors("{{row.answer}}")[0]
    assert "output_text and output_json" in template_errors("{{sample.text}}")[0]
    assert "not a variable" in template_errors("{{item answer}}")[0]


def test_item_fields_name_the_param_that_reads_each_field() -> None:
    grader = MultiGrader.model_validate(
        {
            "type": "multi",
            "name": "m",
            "calculate_output": "exact",
            "graders": {
                "exact": {
                    "type": "string_check",
                    "name": "e",
                    "input": "{{sample.output_text}}",
                    "reference": "{{item.answer}}",
                    "operation": "eq",
                },
                "judge": {
                    "type": "score_model",
                    "name": "j",
                    "model": "tiny-llama",
                    "input": [
                        {
                            "role": "user",
                            "content": [{"type": "input_text", "text": "{{item.question}} {{item.answer}}"}],
                        }
                    ],
                },
            },
        }
    )
    assert item_fields(grader) == {
        "answer": "grader.graders.exact.reference",
        "question": "grader.graders.judge.input[0].content[0].text",
    }

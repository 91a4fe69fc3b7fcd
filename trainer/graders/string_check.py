"""The string_check grader: the rendered input against the rendered reference, reward 1 or 0.

``eq`` and ``ne`` compare exactly; ``like`` passes when the input contains the reference, ``ilike`` the
same ignoring case (OpenAI's semantics).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from contract.graders import StringCheckGrader, StringOperation
from trainer.graders.result import GradeResult, Sample
from trainer.graders.template import TemplateError, render, template_failure


def passes(operation: StringOperation, text: str, reference: str) -> bool:
    if operation == "eq":
        return text == reference
    if operation == "ne":
        return text != reference
    if operation == "like":
        return reference in text
    return reference.casefold() in text.casefold()


def grade_string_check(grader: StringCheckGrader, sample: Sample, item: Mapping[str, Any]) -> GradeResult:
    try:
        text = render(grader.input, sample, item)
        reference = render(grader.reference, sample, item)
    except TemplateError as err:
        return template_failure(grader.name, grader.type, err)
    reward = 1.0 if passes(grader.operation, text, reference) else 0.0
    return GradeResult(reward, grader.name, grader.type)

"""OpenAI's ``python`` grader: the user's ``grade(sample, item)`` run in the sandbox (:mod:`.sandbox`).

Its reward is the number ``grade`` returns. A grader that raises, returns something other than a finite
number, or runs out of time gets reward 0 with ``python_grader_runtime_error`` and the details; a
sandbox that could not run it (the host's fault, not the grader's) gets reward 0 with
``python_grader_server_error`` and its type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainer.graders.result import GraderErrors, GradeResult, Sample, failed
from trainer.graders.sandbox import SandboxLimits, SandboxOutcome, run_python_grader

TYPE = "python"


def errors_of(outcome: SandboxOutcome) -> GraderErrors:
    """OpenAI's flags for a failed call."""
    if outcome.error == "server":
        return GraderErrors(python_grader_server_error=True, python_grader_server_error_type=outcome.details)
    return GraderErrors(python_grader_runtime_error=True, python_grader_runtime_error_details=outcome.details)


def result_of(name: str, outcome: SandboxOutcome) -> GradeResult:
    if outcome.error is None:
        result = GradeResult(float(outcome.value), name, TYPE)
    else:
        result = failed(name, TYPE, errors_of(outcome))
    return result.timed(outcome.seconds)


def grade_python(
    name: str,
    source: str,
    sample: Sample,
    item: Mapping[str, Any],
    limits: SandboxLimits = SandboxLimits(),
) -> GradeResult:
    """The python grader ``name`` (its ``source``) on one sample: never raises."""
    return result_of(name, run_python_grader(source, sample.namespace(), dict(item), limits))

"""The python grader: the sandbox's outcome as OpenAI's reward and error flags."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from tests.trainer.graders.test_sandbox import AVAILABLE, deadline
from trainer.graders.python import grade_python, result_of
from trainer.graders.result import GraderErrors, Sample
from trainer.graders.sandbox import SandboxLimits, SandboxOutcome

LIMITS = SandboxLimits(cpu_seconds=1.0, wall_seconds=4.0)
needs_sandbox = pytest.mark.skipif(not AVAILABLE, reason="no sandbox on this host")

EXACT = """
def grade(sample, item):
    return 1.0 if sample["output_json"] == item["answer"] else 0.0
"""


@needs_sandbox
def test_the_reward_is_the_graders_number() -> None:
    result = grade_python("exact", EXACT, Sample.of_text("42"), MappingProxyType({"answer": 42}), LIMITS)
    assert (result.reward, result.name, result.type) == (1.0, "exact", "python")
    assert not result.errors.any()
    assert 0 < result.execution_time < deadline(LIMITS)
    assert grade_python("exact", EXACT, Sample.of_text("41"), {"answer": 42}, LIMITS).reward == 0.0


@needs_sandbox
def test_a_raising_grader_scores_zero_with_the_runtime_flag() -> None:
    result = grade_python("g", "def grade(sample, item):\n    return item['x']\n", Sample("a"), {}, LIMITS)
    assert result.reward == 0.0
    assert result.errors == GraderErrors(
        python_grader_runtime_error=True,
        python_grader_runtime_error_details="KeyError: 'x' (line 2, in grade: return item['x'])",
    )


@needs_sandbox
def test_a_non_number_scores_zero_with_the_runtime_flag() -> None:
    result = grade_python("g", "def grade(sample, item):\n    return 'yes'\n", Sample("a"), {}, LIMITS)
    assert result.reward == 0.0 and result.errors.python_grader_runtime_error
    assert result.errors.python_grader_runtime_error_details == "grade returned str, not a number"


@needs_sandbox
@pytest.mark.slow
def test_an_endless_loop_scores_zero_within_its_limit() -> None:
    result = grade_python(
        "g", "def grade(sample, item):\n    while True:\n        pass\n", Sample("a"), {}, LIMITS
    )
    assert result.reward == 0.0 and result.errors.python_grader_runtime_error
    assert result.errors.python_grader_runtime_error_details == "timed out after 1 s of CPU time"
    assert result.execution_time < deadline(LIMITS)


def test_a_timeout_says_so() -> None:
    result = result_of("g", SandboxOutcome(None, "timeout", "timed out after 30 s (wall)", 30.1))
    assert result.reward == 0.0 and result.execution_time == 30.1
    assert result.errors.python_grader_runtime_error_details == "timed out after 30 s (wall)"


def test_a_server_failure_sets_the_server_flag() -> None:
    result = result_of("g", SandboxOutcome(None, "server", "sandbox_unavailable", 0.01))
    assert result.reward == 0.0
    assert result.errors == GraderErrors(
        python_grader_server_error=True, python_grader_server_error_type="sandbox_unavailable"
    )

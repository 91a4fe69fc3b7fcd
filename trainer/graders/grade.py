"""One grader on one sample: the dispatcher over the grader types, timed, never raising for a grader's
failure (a reward 0 with OpenAI's flag instead)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from contract.graders import (
    AnyGrader,
    LabelModelGrader,
    MultiGrader,
    PythonGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)
from trainer.graders.model_graders import Judge, grade_label_model, grade_score_model
from trainer.graders.multi import grade_multi
from trainer.graders.result import GraderErrors, GradeResult, Sample, failed
from trainer.graders.string_check import grade_string_check
from trainer.graders.text_similarity import Embed, grade_text_similarity

if TYPE_CHECKING:
    from trainer.graders.sandbox import SandboxLimits

log = logging.getLogger(__name__)


def grade(
    grader: AnyGrader,
    sample: Sample,
    item: Mapping[str, Any],
    *,
    judge: Judge | None = None,
    limits: SandboxLimits | None = None,
    embed: Embed | None = None,
) -> GradeResult:
    """``grader``'s reward for ``sample`` on dataset row ``item``, with its flags and execution time."""
    start = time.perf_counter()
    try:
        result = _dispatch(grader, sample, item, judge, limits, embed)
    except Exception as err:  # a bug of ours or a library's: the caller still gets a reward and a flag
        log.exception("grader %r failed", grader.name)
        result = GradeResult(
            0.0, grader.name, grader.type, GraderErrors(other_error=True), scores={"error": repr(err)[:2000]}
        )
    return result.timed(time.perf_counter() - start)


def _dispatch(
    grader: AnyGrader,
    sample: Sample,
    item: Mapping[str, Any],
    judge: Judge | None,
    limits: SandboxLimits | None,
    embed: Embed | None,
) -> GradeResult:
    if isinstance(grader, StringCheckGrader):
        return grade_string_check(grader, sample, item)
    if isinstance(grader, TextSimilarityGrader):
        return grade_text_similarity(grader, sample, item, embed=embed)
    if isinstance(grader, PythonGrader):
        return _python(grader, sample, item, limits)
    if isinstance(grader, MultiGrader):
        return grade_multi(
            grader, lambda sub: grade(sub, sample, item, judge=judge, limits=limits, embed=embed)
        )
    if judge is None:
        flags = GraderErrors(
            model_grader_server_error=True, model_grader_server_error_details="no judge here"
        )
        return failed(grader.name, grader.type, flags)
    if isinstance(grader, ScoreModelGrader):
        return grade_score_model(grader, sample, item, judge)
    assert isinstance(grader, LabelModelGrader)
    return grade_label_model(grader, sample, item, judge)


def _python(
    grader: PythonGrader, sample: Sample, item: Mapping[str, Any], limits: SandboxLimits | None
) -> GradeResult:
    try:
        from trainer.graders.python import grade_python
    except ImportError:
        flags = GraderErrors(python_grader_server_error=True, python_grader_server_error_type="unavailable")
        return failed(grader.name, grader.type, flags)
    if limits is None:
        result: GradeResult = grade_python(grader.name, grader.source, sample, item)
    else:
        result = grade_python(grader.name, grader.source, sample, item, limits)
    return result

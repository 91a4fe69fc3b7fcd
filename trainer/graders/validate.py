"""A grader checked without running a sample: each problem as (param path, message), the path as the
API names it (``grader.calculate_output``, ``grader.graders.exact.reference``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from contract.graders import (
    AnyGrader,
    LabelModelGrader,
    MultiGrader,
    PythonGrader,
    ScoreModelGrader,
    TextSimilarityGrader,
)
from trainer.graders import wordnet
from trainer.graders.multi import formula_errors
from trainer.graders.template import grader_templates, template_errors
from trainer.graders.text_similarity import NO_EMBEDDINGS

if TYPE_CHECKING:
    from trainer.graders.sandbox import SandboxLimits

Problem = tuple[str, str]


def model_graders(grader: AnyGrader, path: str = "grader") -> Iterator[tuple[str, str]]:
    """Each model grader's ``model`` param path and the model it names (a multi grader's too)."""
    if isinstance(grader, ScoreModelGrader | LabelModelGrader):
        yield f"{path}.model", grader.model
    elif isinstance(grader, MultiGrader):
        for key, sub in grader.graders.items():
            yield from model_graders(sub, f"{path}.graders.{key}")


def grader_errors(
    grader: AnyGrader,
    *,
    judge_models: Callable[[str], bool] | None = None,
    embeddings: bool = False,
    limits: SandboxLimits | None = None,
    path: str = "grader",
) -> list[Problem]:
    """Every problem found in ``grader``: templates, formulas, Python source, metrics this server lacks,
    and (when ``judge_models`` is given) a model grader's model the caller may not use."""
    problems = [
        (where, msg) for where, text in grader_templates(grader, path) for msg in template_errors(text)
    ]
    problems += list(_own_errors(grader, path, judge_models, embeddings, limits))
    return problems


def _own_errors(
    grader: AnyGrader,
    path: str,
    judge_models: Callable[[str], bool] | None,
    embeddings: bool,
    limits: SandboxLimits | None,
) -> Iterator[Problem]:
    if isinstance(grader, MultiGrader):
        for msg in formula_errors(grader.calculate_output, set(grader.graders)):
            yield f"{path}.calculate_output", msg
        for key, sub in grader.graders.items():
            yield from _own_errors(sub, f"{path}.graders.{key}", judge_models, embeddings, limits)
    elif isinstance(grader, TextSimilarityGrader):
        yield from _metric_errors(grader, path, embeddings)
    elif isinstance(grader, PythonGrader):
        yield from _source_errors(grader, path, limits)
    elif (
        isinstance(grader, ScoreModelGrader | LabelModelGrader)
        and judge_models
        and not judge_models(grader.model)
    ):
        yield f"{path}.model", f"no model {grader.model!r} that this team may use"


def _metric_errors(grader: TextSimilarityGrader, path: str, embeddings: bool) -> Iterator[Problem]:
    if grader.evaluation_metric == "cosine" and not embeddings:
        yield f"{path}.evaluation_metric", NO_EMBEDDINGS
    if grader.evaluation_metric == "meteor" and not wordnet.available():
        yield f"{path}.evaluation_metric", wordnet.UNAVAILABLE


def _source_errors(grader: PythonGrader, path: str, limits: SandboxLimits | None) -> Iterator[Problem]:
    try:
        from trainer.graders.sandbox import SandboxLimits, check_python_source
    except ImportError:
        yield f"{path}.source", "python graders are not available on this server"
        return
    problem = check_python_source(grader.source, limits if limits is not None else SandboxLimits())
    if problem:
        yield f"{path}.source", problem

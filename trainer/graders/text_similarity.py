"""The text_similarity grader: the rendered input against the rendered reference by one metric
(:mod:`.metrics`), the reward in [0, 1].

``cosine`` compares two embeddings from an :data:`Embed` function (an embedding model the server is
configured with); without one, validation refuses it and grading flags ``other_error``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from contract.graders import TextSimilarityGrader
from trainer.graders.metrics import METRICS, MetricUnavailable
from trainer.graders.result import GraderErrors, GradeResult, Sample
from trainer.graders.template import TemplateError, render, template_failure

#: Texts to their embedding vectors, in order.
Embed = Callable[[list[str]], Sequence[Sequence[float]]]

NO_EMBEDDINGS = "cosine needs an embedding model, and this server has none configured"


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two vectors, 0 when either is zero."""
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b, strict=True)) / norm if norm else 0.0


def similarity(metric: str, text: str, reference: str, embed: Embed | None = None) -> float:
    """``metric`` of the two texts, clamped to [0, 1] (:class:`MetricUnavailable` when it cannot be had)."""
    if metric == "cosine":
        if embed is None:
            raise MetricUnavailable(NO_EMBEDDINGS)
        vectors = embed([text, reference])
        value = cosine(vectors[0], vectors[1])
    else:
        value = METRICS[metric](text, reference)
    return min(1.0, max(0.0, value))


def grade_text_similarity(
    grader: TextSimilarityGrader, sample: Sample, item: Mapping[str, Any], *, embed: Embed | None = None
) -> GradeResult:
    try:
        text = render(grader.input, sample, item)
        reference = render(grader.reference, sample, item)
    except TemplateError as err:
        return template_failure(grader.name, grader.type, err)
    try:
        value = similarity(grader.evaluation_metric, text, reference, embed)
    except MetricUnavailable as err:
        return GradeResult(
            0.0, grader.name, grader.type, GraderErrors(other_error=True), scores={"error": str(err)}
        )
    return GradeResult(value, grader.name, grader.type, scores={grader.evaluation_metric: value})

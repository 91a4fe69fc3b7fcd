from __future__ import annotations

import pytest

from contract.graders import TextSimilarityGrader
from trainer.graders import wordnet
from trainer.graders.grade import grade
from trainer.graders.result import Sample
from trainer.graders.text_similarity import similarity

LEXICAL = ["fuzzy_match", "bleu", "gleu", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l"]
SENTENCE = "the cat sat on the mat"


@pytest.mark.parametrize("metric", LEXICAL)
def test_identical_score_1_and_disjoint_0(metric: str) -> None:
    assert similarity(metric, SENTENCE, SENTENCE) == pytest.approx(1.0)
    assert similarity(metric, "dog", "cat") == 0.0


def test_hand_checked_values() -> None:
    # hypothesis "the cat sat on a mat": n-gram precisions 5/6, 3/5, 2/4, 1/3, no brevity penalty
    assert similarity("bleu", "the cat sat on a mat", SENTENCE) == pytest.approx(
        (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25
    )
    assert similarity("rouge_1", "the cat ran", "the cat sat") == pytest.approx(2 / 3)
    assert similarity("rouge_2", "the cat ran", "the cat sat") == pytest.approx(1 / 2)
    assert similarity("fuzzy_match", "abcd", "abce") == pytest.approx(0.75)


@pytest.mark.skipif(not wordnet.available(), reason=wordnet.UNAVAILABLE)
def test_meteor_matches_stems() -> None:
    assert similarity("meteor", SENTENCE, SENTENCE) > 0.99
    stem = similarity("meteor", "the cats sat on the mat", SENTENCE)
    assert stem > similarity("meteor", "the dog sat on the mat", SENTENCE)


def test_cosine_needs_an_embedding_model() -> None:
    grader = TextSimilarityGrader.model_validate(
        {
            "type": "text_similarity",
            "name": "c",
            "input": "{{sample.output_text}}",
            "reference": "x",
            "evaluation_metric": "cosine",
        }
    )
    result = grade(grader, Sample.of_text("x"), {})
    assert result.reward == 0.0 and result.errors.other_error and "embedding" in result.scores["error"]
    embed = lambda texts: [[1.0, 0.0] if t == "x" else [0.0, 1.0] for t in texts]  # noqa: E731
    assert grade(grader, Sample.of_text("x"), {}, embed=embed).reward == 1.0
    assert grade(grader, Sample.of_text("y"), {}, embed=embed).reward == 0.0

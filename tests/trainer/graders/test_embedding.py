"""text_similarity's cosine over an embedding model folder (trainer.graders.embedding): the demo base as
the embedding model (a real tokenizer and transformer; any AutoModel folder serves): a text against
itself scores 1, against another text less, a batch embeds as its texts do one by one; a folder that does
not load scores 0 with ``other_error`` and the reason, never an exception."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.graders import TextSimilarityGrader
from trainer.graders.embedding import Embedder, embedder
from trainer.graders.grade import grade
from trainer.graders.result import Sample
from trainer.graders.text_similarity import cosine
from trainer.samples import MODELS_DIR

FOLDER = str(MODELS_DIR / "docs-llama")
COSINE = TextSimilarityGrader.model_validate(
    {
        "type": "text_similarity",
        "name": "close",
        "input": "{{sample.output_text}}",
        "reference": "{{item.answer}}",
        "evaluation_metric": "cosine",
    }
)


def test_a_text_is_closest_to_itself_and_a_batch_embeds_as_its_texts() -> None:
    embed = embedder(FOLDER)
    assert embedder(FOLDER) is embed  # one per process and folder
    same = grade(
        COSINE,
        Sample.of_text("The capital of Japan is Tokyo."),
        {"answer": "The capital of Japan is Tokyo."},
        embed=embed,
    )
    other = grade(
        COSINE,
        Sample.of_text("def f(x): return x"),
        {"answer": "The capital of Japan is Tokyo."},
        embed=embed,
    )
    assert same.reward == pytest.approx(1.0, abs=1e-5) and not same.errors.other_error
    assert 0.0 <= other.reward < same.reward - 1e-3
    texts = ["a short one", "a rather longer text, padded in a batch with the short one"]
    batch = embed(texts)
    for text, vector in zip(texts, batch, strict=True):
        assert cosine(vector, embed([text])[0]) == pytest.approx(1.0, abs=1e-4)


def test_a_folder_that_does_not_load_scores_0_with_its_reason(tmp_path: Path) -> None:
    result = grade(COSINE, Sample.of_text("x"), {"answer": "x"}, embed=Embedder(str(tmp_path / "absent")))
    assert result.reward == 0.0 and result.errors.other_error
    assert "did not load" in str(result.scores.get("error")), result.scores

"""A model card says the method that trained the model (trainer.run.model_card), not supervised for all."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.method import DpoMethod, SupervisedMethod
from trainer.run.model_card import model_card
from trainer.spec import JobSpec


@pytest.mark.parametrize(
    ("method", "says"),
    [(SupervisedMethod(), "supervised fine-tuning"), (DpoMethod(), "direct preference optimization")],
)
def test_the_card_names_the_method(method: object, says: str) -> None:
    spec = JobSpec(model="tiny-llama", training_file=Path("train.jsonl"), method=method)  # type: ignore[arg-type]
    card = model_card(spec, adapter=False, hyperparameters={}, figures={}, train_examples=4, valid_examples=0)
    trained = next(line for line in card.splitlines() if line.startswith("Trained with "))
    assert says in trained and (says == "supervised fine-tuning") == ("supervised" in trained)

"""A tokenized training example and a DPO preference pair of two of them. No torch import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

IGNORE_INDEX = -100


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]

    @property
    def num_loss_tokens(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE_INDEX)


@dataclass
class PreferencePair(Example):
    """A DPO example: itself the chosen (preferred) conversation, ``rejected`` the non-preferred one; the
    labels of each mark its output's tokens only (the shared input is context). Being an Example, a
    pair goes through the length checks and reports as the chosen sequence, and counts its tokens twice."""

    rejected: Example = field(default_factory=lambda: Example([], []))

    def cut(self, n: int) -> PreferencePair:
        """Both sequences cut to their first ``n`` tokens."""
        r = self.rejected
        return PreferencePair(self.input_ids[:n], self.labels[:n], Example(r.input_ids[:n], r.labels[:n]))


@dataclass
class RolloutPrompt(Example):
    """A reinforcement example: ``input_ids`` the prompt rendered up to the assistant's turn (no label:
    what is learned is sampled during training), ``item`` the dataset row graders read as ``item``."""

    item: dict[str, Any] = field(default_factory=dict)

"""What a run's graders reach outside the run with, handed down by whoever runs it (a worker:
worker.grading) to the method (trainer.method.base.MethodSetup)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.graders.model_graders import Judge
    from trainer.graders.sandbox import SandboxLimits
    from trainer.graders.text_similarity import Embed


@dataclass(frozen=True)
class Grading:
    """A Python grader's sandbox limits (None: SandboxLimits' defaults), the model graders' judge (None:
    none here, and a model grader scores 0 with ``model_grader_server_error``) and the embeddings of
    text_similarity's cosine (None: none, and cosine scores 0 with ``other_error``)."""

    limits: SandboxLimits | None = None
    judge: Judge | None = None
    embed: Embed | None = None

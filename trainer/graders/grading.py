"""What a run's graders reach outside the run with, handed down by whoever runs it (a worker:
worker.grading) to the method (trainer.method.base.MethodSetup)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.graders.model_graders import Judge
    from trainer.graders.sandbox import SandboxLimits


@dataclass(frozen=True)
class Grading:
    """A Python grader's sandbox limits (None: SandboxLimits' defaults) and the model graders' judge
    (None: none here, and a model grader scores 0 with ``model_grader_server_error``)."""

    limits: SandboxLimits | None = None
    judge: Judge | None = None

"""What a fine-tuning method owns in a run (:class:`TrainingMethod`): its set-up before the engine is
built, its micro-batches, its loss, what each step and each validation report. The loop
(:mod:`trainer.run.loop`) and the step (:mod:`trainer.run.step`) are the same for every method."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from trainer.data.example import Example
from trainer.events import EvalEvent, Event, PreferenceMetrics, RewardMetrics
from trainer.graders.grading import Grading
from trainer.run.distributed import DistContext

if TYPE_CHECKING:
    import torch

    from contract.hyperparameters import ResolvedHyperparameters
    from trainer.run.step import MicroBatch


@dataclass(frozen=True)
class Batching:
    """How the run cuts examples into micro-batches: the resolved runtime and the device."""

    hp: ResolvedHyperparameters
    pad_id: int
    device: torch.device


@dataclass(frozen=True)
class MethodSetup:
    """What a method may prepare before the engine is built (the model as the run will train it)."""

    model: Any
    train: list[Example]
    valid: list[Example]
    out: Path
    batching: Batching
    #: The base model's name (a reference table's fingerprint) and whether LoRA trains.
    model_name: str
    lora: bool
    dist: DistContext | None
    #: The weights are row-sharded over the ranks (every rank runs every pass).
    sharded: bool
    emit: Callable[[Event], None]
    #: The base model's tokenizer (a reinforcement job grades its completions as text).
    tokenizer: Any = None
    #: The graders' sandbox limits and judge (the worker's, worker.grading); the defaults: no judge.
    grading: Grading = field(default_factory=Grading)


class TrainingMethod(Protocol):
    """A fine-tuning method in a run (see the module doc)."""

    #: Validate the base before the first step too (a run that starts at step 0 with a validation set).
    eval_before_training: bool

    def prepare(self, setup: MethodSetup) -> None:
        """Before the engine or a checkpoint touches the weights (DPO: dropout off, the reference)."""
        ...

    def micro_batches(
        self, examples: list[Example], index: list[int], b: Batching, *, step: int = 0
    ) -> Iterator[MicroBatch]:
        """``examples`` (at ``index`` in the training set) as this method's micro-batches for the run's
        optimizer step ``step`` (0-based, counted over the epochs: what a rollout's seed derives from)."""
        ...

    def filler(self, example: Example, b: Batching) -> MicroBatch:
        """A micro-batch a rank runs with a zero loss to match the others' count (sharded weights)."""
        ...

    def loss(self, model: Any, mb: Any) -> torch.Tensor:
        """A micro-batch's summed loss over its ``num_learned`` units (tokens, pairs), with grad."""
        ...

    def step_metrics(self, dist: DistContext | None) -> PreferenceMetrics | RewardMetrics | None:
        """What the finished step reports beside its loss (collective with ranks)."""
        ...

    def evaluate(
        self,
        model: Any,
        valid: list[Example],
        b: Batching,
        dist: DistContext | None,
        sharded: bool,
        step: int,
    ) -> EvalEvent:
        """The validation set's loss (and the method's metrics) on the current weights."""
        ...

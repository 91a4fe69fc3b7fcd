"""The typed boundary between a training run and its observers: the events
:func:`trainer.run.loop.run_training` passes to its ``on_event`` callback.

Every event is a frozen dataclass; consumers (the job runner's database reporter, the worker's
telemetry, the CLI) dispatch on the event class. Each still carries a ``type`` string, and
:meth:`Event.as_dict` gives ``{"type": ..., **fields}`` as JSON-ready data. An ``on_event`` callback
that raises aborts the run (the exception propagates out of run_training).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from offload.step_metrics import StepMetrics


@dataclass(frozen=True)
class Event:
    type: ClassVar[str] = "event"

    def as_dict(self) -> dict[str, Any]:
        return {"type": self.type, **asdict(self)}


@dataclass(frozen=True)
class LogEvent(Event):
    """A human-readable message (validated files, resumed from a checkpoint, ...)."""

    type: ClassVar[str] = "log"
    message: str
    level: str = "info"
    data: dict[str, Any] = field(default_factory=dict)


def skipped_step_warning(m: StepMetrics, step: int) -> LogEvent:
    """The warning for a step the engine skipped (its gradient norm was not finite; nothing changed)."""
    scale = f" at loss scale {m.loss_scale:g}" if m.loss_scale is not None else ""
    return LogEvent(
        f"Step {step}: gradient norm is {m.grad_norm}{scale}; the step was skipped (no weight changed)",
        level="warning",
        data={"step": step, "grad_norm": str(m.grad_norm), "loss_scale": m.loss_scale},  # str: inf/nan
    )


@dataclass(frozen=True)
class Resolved(Event):
    """The run decided the job's settings again (trainer.resolve.for_run): the new resolution, to be
    recorded beside the job's earlier ones (the reporter appends it to the job's row)."""

    type: ClassVar[str] = "resolved"
    #: A contract.job.Resolution as JSON (``model_dump(mode="json")``).
    resolution: dict[str, Any]
    #: What changed from the resolution it replaces: ``{path: {"from": ..., "to": ...}}``.
    changes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RunStarted(Event):
    type: ClassVar[str] = "run_started"
    total_steps: int
    start_step: int
    #: ResolvedHyperparameters as a dict.
    hyperparameters: dict[str, Any]
    device: str
    dtype: str
    mode: str
    num_parameters: int
    trainable_parameters: int
    num_examples: int
    num_validation_examples: int
    #: The weights ran sharded over the ranks with FSDP2 (the resolution's ``engine.shard_params``).
    sharded: bool = False
    #: The job's ranks (data-parallel processes).
    world_size: int = 1


@dataclass(frozen=True)
class PreferenceMetrics:
    """A DPO step's (or validation set's) pairs, means over them: rewards are beta x (policy - reference)
    summed log-probabilities of a completion; ``accuracy`` the share of pairs whose chosen reward is
    above the rejected one's (trainer.method.dpo)."""

    chosen_reward: float
    rejected_reward: float
    reward_margin: float
    accuracy: float


@dataclass(frozen=True)
class GradedSample:
    """One sampled completion as graded (shown in a reinforcement job's evaluation events)."""

    prompt: str
    completion: str
    reward: float
    #: The grader's error flags that were set (empty when it graded cleanly).
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RewardMetrics:
    """A reinforcement step's (or evaluation's) completions: their rewards, the sub-rewards of a multi
    grader's graders (means by name), the completions' tokens, and where the step's time went
    (trainer.method.reinforcement)."""

    reward_mean: float
    reward_min: float
    reward_max: float
    #: Completions graded.
    samples: int
    #: Mean tokens of a completion, and the share that ran to max_completion_tokens without stopping.
    completion_tokens_mean: float
    truncated_fraction: float
    #: Completions whose grading set an error flag (reward 0), and the flags' counts by name.
    grader_errors: int
    grader_error_flags: dict[str, int] = field(default_factory=dict)
    sub_rewards: dict[str, float] = field(default_factory=dict)
    #: Wall-clock seconds this rank spent sampling and grading (the rest of the step trains).
    generation_seconds: float = 0.0
    grading_seconds: float = 0.0
    #: Completion tokens sampled per second of generation.
    rollout_tokens_per_second: float = 0.0
    #: An evaluation's first few completions with their rewards (empty for a training step).
    examples: list[GradedSample] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        """Every figure but the examples, flat: numbers, and the flags' and sub-rewards' dicts by name."""
        return {k: v for k, v in asdict(self).items() if k != "examples"}


@dataclass(frozen=True)
class StepEvent(Event):
    """One optimizer step: the mean token loss of its batch and the engine's step record."""

    type: ClassVar[str] = "step"
    step: int
    total_steps: int
    epoch: int
    loss: float
    lr: float
    tokens: int
    tokens_per_second: float
    step_seconds: float
    stall_seconds: float
    stall_fraction: float
    #: The engine's record of this step (what ``ZenFlowEngine.step()`` returned).
    engine: StepMetrics
    #: With several ranks: the non-padding tokens this rank processed (``tokens`` is the whole step's,
    #: the same on every rank); None in a single process. Prometheus counts these, so a sum over the
    #: ranks' series is the job's throughput.
    rank_tokens: int | None = None
    #: A DPO job's rewards and preference accuracy over the step's pairs (None: supervised); ``loss``
    #: is then the mean DPO loss over them.
    preference: PreferenceMetrics | None = None
    #: A reinforcement job's rewards over the step's completions (None: another method); ``loss`` is then
    #: the clipped policy-gradient loss.
    reward: RewardMetrics | None = None

    def as_dict(self) -> dict[str, Any]:
        # StepMetrics.as_dict() adds the derived stall_fraction that dataclasses.asdict() leaves out.
        return {**super().as_dict(), "engine": self.engine.as_dict()}


@dataclass(frozen=True)
class EvalEvent(Event):
    type: ClassVar[str] = "eval"
    step: int
    valid_loss: float
    valid_tokens: int
    #: A DPO job's validation pairs (None: supervised); ``valid_loss`` is then their mean DPO loss.
    preference: PreferenceMetrics | None = None
    #: A reinforcement job's validation completions (None: another method); ``valid_loss`` is then the
    #: negative mean reward (what the method minimises), ``valid_tokens`` the completions' tokens.
    reward: RewardMetrics | None = None


@dataclass(frozen=True)
class CheckpointSaved(Event):
    type: ClassVar[str] = "checkpoint"
    step: int
    path: str
    #: {step, train_loss, valid_loss, ...} at the checkpoint.
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointRemoved(Event):
    """An older checkpoint deleted to respect keep_checkpoints."""

    type: ClassVar[str] = "checkpoint_removed"
    step: int
    path: str


@dataclass(frozen=True)
class RunFinished(Event):
    type: ClassVar[str] = "run_finished"
    steps: int
    cancelled: bool
    final_model_dir: str | None
    train_loss: float | None
    valid_loss: float | None
    trained_tokens: int


@dataclass(frozen=True)
class ErrorEvent(Event):
    """The run failed; emitted just before the exception leaves run_training."""

    type: ClassVar[str] = "error"
    message: str
    error_type: str
    step: int | None = None
    #: For data errors: the DatasetValidationError.errors list.
    errors: list[dict[str, Any]] = field(default_factory=list)


EventCallback = Callable[[Event], None]

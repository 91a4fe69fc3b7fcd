"""A reinforcement job's events, built directly (no training run): a step and an evaluation with rewards."""

from __future__ import annotations

from offload.step_metrics import StepMetrics
from trainer.events import EvalEvent, GradedSample, RewardMetrics, StepEvent

ENGINE = StepMetrics(
    step=20, wall_seconds=0.5, compute_seconds=0.4, stall_seconds=0.1, cpu_optimizer_seconds=0.2,
    bytes_device_to_host=0, bytes_host_to_device=0, device_optimizer_state_bytes=0,
)  # fmt: skip

REWARD = RewardMetrics(
    reward_mean=0.41,
    reward_min=0.0,
    reward_max=1.0,
    samples=16,
    completion_tokens_mean=12.5,
    truncated_fraction=0.125,
    grader_errors=2,
    grader_error_flags={"model_grader_parse_error": 2},
    sub_rewards={"exact match": 0.5, "fuzzy{{x}}": 0.25},
    generation_seconds=1.5,
    grading_seconds=0.25,
    rollout_tokens_per_second=133.0,
)

EXAMPLES = [
    GradedSample(prompt="Capital of France?", completion="Paris" + " and more" * 400, reward=1.0),
    GradedSample(prompt="Capital of Peru?", completion="Quito", reward=0.0),
    GradedSample(prompt="Capital of Chad?", completion="", reward=0.0, errors=["model_grader_parse_error"]),
    GradedSample(prompt="Capital of Mali?", completion="Bamako", reward=1.0),
]


def reward_step(**kw: object) -> StepEvent:
    fields: dict[str, object] = dict(
        step=20, total_steps=120, epoch=0, loss=0.0, lr=1e-5, tokens=400, tokens_per_second=800.0,
        step_seconds=0.5, stall_seconds=0.1, stall_fraction=0.2, engine=ENGINE, reward=REWARD,
    )  # fmt: skip
    return StepEvent(**{**fields, **kw})  # type: ignore[arg-type]


def reward_eval() -> EvalEvent:
    valid = RewardMetrics(
        reward_mean=0.44, reward_min=0.0, reward_max=1.0, samples=32, completion_tokens_mean=10.0,
        truncated_fraction=0.0, grader_errors=0, examples=EXAMPLES,
    )  # fmt: skip
    return EvalEvent(step=20, valid_loss=-0.44, valid_tokens=320, reward=valid)

"""The fine-tuning methods, as OpenAI's API names them: a discriminated union on ``type``.

A method's request (:data:`MethodRequest`) carries its own settings beside the shared hyperparameters
(DPO's ``beta``); its resolution (:data:`ResolvedMethod`) has them concrete. What each method does (its
data, loss and metrics) is ``trainer.method``'s; a new method is a new member of both unions here and a
module there.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from contract.graders import Grader
from contract.serving import JudgeModels
from contract.values import Auto

_N = TypeVar("_N", int | str, float | str)

MethodName = Literal["supervised", "dpo", "reinforcement"]
ReasoningEffort = Literal["default", "low", "medium", "high"]


class _Method(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class SupervisedMethod(_Method):
    """Supervised fine-tuning on chat or prompt/completion examples."""

    type: Literal["supervised"] = "supervised"


class DpoMethod(_Method):
    """Direct preference optimization on preference pairs (input, preferred_output, non_preferred_output):
    the sigmoid loss over the chosen and rejected completions against a frozen reference."""

    type: Literal["dpo"] = "dpo"
    beta: float | Auto = "auto"
    """The KL penalty's weight: rewards are beta x (policy - reference) log-probabilities; auto: 0.1."""

    @field_validator("beta")
    @classmethod
    def _beta(cls, v: float | str) -> float | str:
        if isinstance(v, bool) or (not isinstance(v, str) and not 0 < v <= 100):
            raise ValueError("must be a number in (0, 100] or 'auto'")
        return v


def _positive_or_auto(v: _N, top: float, what: str) -> _N:
    if isinstance(v, bool) or (not isinstance(v, str) and not 0 < v <= top):
        raise ValueError(f"must be {what} in (0, {top:g}] or 'auto'")
    return v


class ReinforcementMethod(_Method):
    """Reinforcement fine-tuning (OpenAI's ``reinforcement``): for each prompt the policy samples a group
    of completions, the grader scores them, and a clipped policy-gradient step follows the group-normalised
    advantages (GRPO; trainer.method.reinforcement). OpenAI's hyperparameters ``batch_size`` (prompts per
    step), ``n_epochs``, ``learning_rate_multiplier`` and ``eval_interval`` (``eval_every``) are the shared
    ones; these are the method's own."""

    type: Literal["reinforcement"] = "reinforcement"
    grader: Grader
    compute_multiplier: float | Auto = "auto"
    """The exploration budget: completions sampled per prompt are 8 x this (2 to 64); auto: 1."""
    eval_samples: int | Auto = "auto"
    """Completions sampled per validation prompt at each evaluation; auto: 4."""
    reasoning_effort: ReasoningEffort = "default"
    """Accepted for OpenAI's clients; a model without a reasoning mode ignores it (it is recorded)."""
    max_completion_tokens: int | Auto = "auto"
    """Tokens a completion may have (our extra); auto: 256, and at most what max_seq_length leaves after
    the longest prompt."""
    temperature: float | Auto = "auto"
    """The rollouts' sampling temperature (our extra); auto: 1.0 (the policy's own distribution)."""
    kl_beta: float | Auto = "auto"
    """The KL penalty's weight against the reference (our extra); auto: 0 (KL-free). Above 0 it needs
    LoRA: the reference is the adapter disabled, never a second copy of the weights."""
    judges: JudgeModels | None = None
    """The model graders' models as the API resolved them for the job's team at create (no client
    gives it: the API's request schema has no such field); None: the grader has no model graders."""

    @field_validator("compute_multiplier")
    @classmethod
    def _compute(cls, v: float | str) -> float | str:
        return _positive_or_auto(v, 8, "a number")

    @field_validator("eval_samples", "max_completion_tokens")
    @classmethod
    def _counts(cls, v: int | str) -> int | str:
        return _positive_or_auto(v, 4096, "an integer")

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float | str) -> float | str:
        return _positive_or_auto(v, 2, "a number")

    @field_validator("kl_beta")
    @classmethod
    def _kl(cls, v: float | str) -> float | str:
        if isinstance(v, bool) or (not isinstance(v, str) and not 0 <= v <= 10):
            raise ValueError("must be a number in [0, 10] or 'auto'")
        return v


MethodRequest = Annotated[SupervisedMethod | DpoMethod | ReinforcementMethod, Field(discriminator="type")]


class ResolvedSupervised(_Method):
    type: Literal["supervised"] = "supervised"


class ResolvedDpo(_Method):
    type: Literal["dpo"] = "dpo"
    beta: float = Field(gt=0, le=100)


class ResolvedReinforcement(_Method):
    type: Literal["reinforcement"] = "reinforcement"
    grader: Grader
    compute_multiplier: float = Field(gt=0, le=8)
    #: Completions sampled per prompt (8 x compute_multiplier, 2 to 64).
    samples_per_prompt: int = Field(ge=2, le=64)
    eval_samples: int = Field(ge=1, le=4096)
    reasoning_effort: ReasoningEffort = "default"
    max_completion_tokens: int = Field(ge=1, le=4096)
    temperature: float = Field(gt=0, le=2)
    kl_beta: float = Field(ge=0, le=10)
    #: The clipped objective's epsilon (PPO's; one update per rollout keeps the ratio at 1).
    clip_epsilon: float = Field(0.2, gt=0, le=1)


ResolvedMethod = Annotated[
    ResolvedSupervised | ResolvedDpo | ResolvedReinforcement, Field(discriminator="type")
]

"""The fine-tuning methods, as OpenAI's API names them: a discriminated union on ``type``.

A method's request (:data:`MethodRequest`) carries its own settings beside the shared hyperparameters
(DPO's ``beta``); its resolution (:data:`ResolvedMethod`) has them concrete. What each method does (its
data, loss and metrics) is ``trainer.method``'s; a new method is a new member of both unions here and a
module there.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from contract.values import Auto

MethodName = Literal["supervised", "dpo"]


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


MethodRequest = Annotated[SupervisedMethod | DpoMethod, Field(discriminator="type")]


class ResolvedSupervised(_Method):
    type: Literal["supervised"] = "supervised"


class ResolvedDpo(_Method):
    type: Literal["dpo"] = "dpo"
    beta: float = Field(gt=0, le=100)


ResolvedMethod = Annotated[ResolvedSupervised | ResolvedDpo, Field(discriminator="type")]

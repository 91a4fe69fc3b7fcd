"""How a job trains: LoRA (:class:`LoraSpec`) or all weights; supervised or DPO (:class:`DpoSpec`).

A job is DPO when ``hyperparameters.dpo`` is set (``method: {"type": "dpo"}`` in the API); its data is
then OpenAI's preference format (:mod:`trainer.data.preference`) and its loss :mod:`trainer.run.dpo`.
This module does not import torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

Method = Literal["supervised", "dpo"]


class LoraSpec(BaseModel):
    """LoRA through peft: only the adapter trains; the export is the merged model plus the adapter."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    r: int = Field(8, ge=1, le=65_536)
    alpha: float = Field(16.0, gt=0, le=65_536)
    dropout: float = Field(0.0, ge=0, lt=1)
    #: Module names to adapt (peft's rule: a module whose name is the entry or ends with "." + the
    #: entry), or "all-linear" (every linear layer but the output head).
    target_modules: list[str] | Literal["all-linear"] = "all-linear"

    @field_validator("r", mode="before")
    @classmethod
    def _no_bool(cls, v: object) -> object:
        if isinstance(v, bool):
            raise ValueError("must be an integer, not a boolean")
        return v

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, list):
            if not 1 <= len(v) <= 256:
                raise ValueError("give between 1 and 256 module names, or 'all-linear'")
            if any(not 1 <= len(name) <= 256 for name in v):
                raise ValueError("each module name must be 1 to 256 characters long")
        return v


#: What ``beta: "auto"`` resolves to: the DPO paper's (Rafailov et al. 2023) and TRL's default. It is the
#: KL penalty's weight: 0.1 lets the policy move well away from the reference in a few hundred steps
#: (0.5 holds it close, 0.01 lets it drift into degenerate text); no data-dependent rule is known to beat it.
AUTO_DPO_BETA = 0.1


class DpoSpec(BaseModel):
    """Direct preference optimization (``method: {"type": "dpo"}``): the sigmoid loss over the chosen and
    rejected completions' summed log-probabilities against a frozen reference (trainer.run.dpo)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    #: The KL penalty's weight: rewards are beta x (policy - reference) log-probabilities.
    beta: float | Literal["auto"] = "auto"

    @field_validator("beta")
    @classmethod
    def _beta(cls, v: float | str) -> float | str:
        if isinstance(v, bool) or (not isinstance(v, str) and not 0 < v <= 100):
            raise ValueError("must be a number in (0, 100] or 'auto'")
        return v

    def resolved(self) -> DpoSpec:
        """This spec with ``beta`` a number (``auto``: :data:`AUTO_DPO_BETA`)."""
        return DpoSpec(beta=AUTO_DPO_BETA if self.beta == "auto" else self.beta)

    @property
    def beta_value(self) -> float:
        return float(self.resolved().beta)


def packing_error(title: str, value: object) -> ValidationError:
    """The error of ``packing: true`` in a DPO job, at ``packing``: a pair's two completions are scored
    one per row (their summed log-probabilities compared), so rows are never packed; ``auto`` is off."""
    message = "DPO scores each completion in a row of its own: packing must be false or 'auto'"
    return ValidationError.from_exception_data(
        title,
        [InitErrorDetails(type=PydanticCustomError("value_error", message), loc=("packing",), input=value)],
    )

"""LoRA through peft: :class:`LoraSpec` (``hyperparameters.lora``; None: every weight trains)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class LoraSpec(BaseModel):
    """LoRA through peft: only the adapter trains; the export is the merged model plus the adapter."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    r: int = Field(8, ge=1, le=65_536)
    """The adapter's rank."""
    alpha: float = Field(16.0, gt=0, le=65_536)
    """The adapter's scale is alpha / r."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names to adapt (peft's rule: a module whose name is the entry or ends with "." + the entry),
    or "all-linear" (every linear layer but the output head)."""

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

"""Validated settings of the offload engine."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

EngineMode = Literal["device", "offload", "zenflow"]


class EngineConfig(BaseModel):
    """How the engine updates parameters.

    ``device``: plain AdamW on the device. ``offload``: synchronous ZeRO-Offload style (CPU AdamW
    every step, the device waits). ``zenflow``: top-k columns on the device every step, the rest
    accumulated and applied by the CPU optimizer in the background, one window stale.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: EngineMode = "zenflow"
    lr: float = Field(1e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    # Global gradient-norm clipping over both the device and the CPU part; None disables it.
    max_grad_norm: float | None = Field(1.0, gt=0)

    # ZenFlow knobs (ignored by the other modes).
    topk_ratio: float = Field(0.1, gt=0, le=1)
    update_interval: int | Literal["auto"] = 4
    select_interval: int | Literal["auto"] = "auto"
    full_warm_up_rounds: int = Field(0, ge=0)
    # Upper bound on an "auto" window, so staleness stays bounded.
    max_update_interval: int = Field(16, ge=1)
    # Fraction of this process's CPU cores given to the CPU optimizer worker.
    cpu_optimizer_cores_ratio: float = Field(0.5, gt=0, le=1)
    # Run the CPU window update in the background (True) or block on it at the boundary (False, an ablation).
    overlap_step: bool = True

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        b1, b2 = self.betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError("betas: each must be in [0, 1)")
        if isinstance(self.update_interval, int) and self.update_interval < 1:
            raise ValueError("update_interval: must be >= 1 or 'auto'")
        if isinstance(self.select_interval, int):
            if self.select_interval < 1:
                raise ValueError("select_interval: must be >= 1 or 'auto'")
            if isinstance(self.update_interval, int) and self.select_interval < self.update_interval:
                raise ValueError("select_interval: must be >= update_interval")
        return self

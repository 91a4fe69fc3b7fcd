"""Validated settings of the offload engine."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

EngineMode = Literal["device", "offload", "zenflow"]


class EngineConfig(BaseModel):
    """How the engine updates parameters.

    ``device``: plain AdamW on the device. ``offload``: synchronous ZeRO-Offload style (CPU AdamW
    every step, the device waits). ``zenflow``: top-k columns on the device every step, the rest
    accumulated and applied by the CPU optimizer in the background, one window stale.

    All fields are validated on construction; a bad value raises ``pydantic.ValidationError`` whose
    message names the field (e.g. ``topk_ratio: must be in (0, 1]``).
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

    # --- extensions (not in the original contract; defaults keep the documented behaviour) ---
    # select_interval="auto" reselects when the caller signals a new epoch (engine.new_epoch()); a caller
    # that never does gets a reselection every this many steps instead.
    select_interval_fallback: int = Field(100, ge=1)
    # CPU cores the engine plans its split with; None = the cores this process may run on.
    cpu_threads: int | None = Field(None, ge=1)
    # Pin the CPU optimizer worker (and the threads it starts) to its own cores (Linux only).
    bind_worker_cores: bool = False
    # zenflow: the CPU's once-per-window AdamW step on the window-mean gradient uses the sum of the window's
    # per-step learning rates (the linear scaling rule: lr * window length at a constant lr), so unselected
    # weights move as far per training step as the selected ones, during lr warm-up and decay too; False =
    # the boundary's plain lr once per window (gradient-accumulation semantics), which lets them lag by
    # about update_interval times early in training.
    scale_cpu_lr: bool = True
    # Where zenflow accumulates the unselected gradient over a window: "host" = every step's gradient is
    # copied to pinned host staging and added into an fp32 host accumulator by the worker (no extra device
    # memory; ~10 CPU bytes/param/step); "device" = an fp32 accumulator on the device (+4 device
    # bytes/param, reported as device_buffer_bytes), copied to the host once per window (CPU work per step
    # is then only the window's AdamW / window length).
    accumulate_on: Literal["host", "device"] = "host"
    # Largest slice (elements) the CPU optimizer updates before it lets waiting gradient copies run.
    cpu_chunk_elements: int = Field(1 << 23, ge=1024)

    @field_validator("update_interval", "select_interval", mode="before")
    @classmethod
    def _no_bool(cls, v: object, info: ValidationInfo) -> object:
        # bool is an int subclass: True would silently become an interval of 1.
        if isinstance(v, bool):
            raise ValueError(f"{info.field_name}: must be an integer >= 1 or 'auto', not a boolean")
        return v

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

"""Validated settings of the offload engine."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

EngineMode = Literal["device", "offload", "zenflow"]

#: Upper bound of the step-count knobs (update/select windows, fallbacks): beyond any job's steps (so
#: select_interval=10**6 still means "never reselect"), and small enough that no counter overflows.
MAX_INTERVAL_STEPS = 10_000_000
#: Upper bound of ``full_warm_up_rounds`` (steps of full updates before the windows start).
MAX_WARM_UP_STEPS = 10_000_000
#: Upper bound of ``weight_decay``: AdamW multiplies the weights by (1 - lr * weight_decay) each step.
MAX_WEIGHT_DECAY = 10.0
#: Upper bound of ``max_grad_norm`` (a larger threshold never clips; give null to disable clipping).
MAX_GRAD_NORM = 1e6
#: Upper bound of ``cpu_threads`` and of ``cpu_chunk_elements``.
MAX_CPU_THREADS = 4096
MAX_CHUNK_ELEMENTS = 1 << 31


class EngineConfig(BaseModel):
    """How the engine updates parameters.

    ``device``: plain AdamW on the device. ``offload``: synchronous ZeRO-Offload style (CPU AdamW
    every step, the device waits). ``zenflow``: top-k columns on the device every step, the rest
    accumulated and applied by the CPU optimizer in the background, one window stale.

    All fields are validated on construction; a bad value raises ``pydantic.ValidationError`` whose
    message names the field (e.g. ``topk_ratio: must be in (0, 1]``). Every number is bounded above
    and finite (NaN and infinities are refused), so no value can overflow a counter or only fail
    once training runs.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    mode: EngineMode = "zenflow"
    lr: float = Field(1e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0, le=1.0)
    weight_decay: float = Field(0.0, ge=0, le=MAX_WEIGHT_DECAY)
    # Global gradient-norm clipping over both the device and the CPU part; None disables it.
    max_grad_norm: float | None = Field(1.0, gt=0, le=MAX_GRAD_NORM)

    # ZenFlow knobs (ignored by the other modes).
    topk_ratio: float = Field(0.1, gt=0, le=1)
    update_interval: int | Literal["auto"] = 4
    select_interval: int | Literal["auto"] = "auto"
    full_warm_up_rounds: int = Field(0, ge=0, le=MAX_WARM_UP_STEPS)
    # Upper bound on an "auto" window, so staleness stays bounded.
    max_update_interval: int = Field(16, ge=1, le=MAX_INTERVAL_STEPS)
    # Fraction of this process's CPU cores given to the CPU optimizer worker.
    cpu_optimizer_cores_ratio: float = Field(0.5, gt=0, le=1)
    # Run the CPU window update in the background (True) or block on it at the boundary (False, an ablation).
    overlap_step: bool = True

    # --- extensions (not in the original contract; defaults keep the documented behaviour) ---
    # select_interval="auto" reselects when the caller signals a new epoch (engine.new_epoch()); a caller
    # that never does gets a reselection every this many steps instead.
    select_interval_fallback: int = Field(100, ge=1, le=MAX_INTERVAL_STEPS)
    # CPU cores the engine plans its split with; None = the cores this process may run on.
    cpu_threads: int | None = Field(None, ge=1, le=MAX_CPU_THREADS)
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
    cpu_chunk_elements: int = Field(1 << 23, ge=1024, le=MAX_CHUNK_ELEMENTS)

    @field_validator(
        "update_interval", "select_interval", "full_warm_up_rounds", "max_update_interval",
        "select_interval_fallback", "cpu_threads", "cpu_chunk_elements",
        mode="before",
    )
    @classmethod
    def _no_bool(cls, v: object, info: ValidationInfo) -> object:
        # bool is an int subclass: True would silently become an interval of 1.
        if isinstance(v, bool):
            raise ValueError("must be an integer, not a boolean")
        return v

    @field_validator("update_interval", "select_interval")
    @classmethod
    def _interval(cls, v: int | str, info: ValidationInfo) -> int | str:
        if isinstance(v, int) and not 1 <= v <= MAX_INTERVAL_STEPS:
            raise ValueError(f"must be an integer in [1, {MAX_INTERVAL_STEPS}] or 'auto'")
        return v

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        b1, b2 = self.betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError("betas: each must be in [0, 1)")
        if (isinstance(self.select_interval, int) and isinstance(self.update_interval, int)
                and self.select_interval < self.update_interval):
            raise ValueError("select_interval: must be >= update_interval")
        return self

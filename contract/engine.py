"""The engine's public settings: what a job may set (:class:`EngineRequest`), what it runs with once
resolved (:class:`ResolvedEngine`), and the knobs both share with the engine itself (:class:`EngineKnobs`,
whose defaults ``offload.config.EngineConfig`` inherits).

Everything else the engine can be told (its CPU threads and their placement, chunk sizes, loss-scale
constants, ...) is a worker's tuning, never a job's: ``offload.config.EngineConfig`` has those fields and
a worker sets them for its jobs (``ZENFLOW_ENGINE_TUNING``). A request naming one is refused, naming it.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from contract.values import Auto

#: How parameters are updated: ``device`` AdamW on the device; ``offload`` the CPU AdamW every step, the
#: device waiting (ZeRO-Offload); ``zenflow`` the important columns on the device every step, the rest on
#: the CPU in the background, one window stale.
EngineMode = Literal["device", "offload", "zenflow"]
ENGINE_MODES: tuple[EngineMode, ...] = get_args(EngineMode)
#: Where zenflow sums a window's unselected gradient.
Accumulator = Literal["host", "device"]
#: The accumulator of a job that does not choose, and of the engine itself.
DEFAULT_ACCUMULATOR: Accumulator = "host"
#: The dtype of the CPU optimizer's moments (exp_avg, exp_avg_sq) beside its fp32 master weights.
HostMoments = Literal["fp32", "bf16"]
HOST_MOMENT_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2}

#: Upper bound of the step-count knobs (windows, selections): beyond any job's steps, and small enough
#: that no counter overflows.
MAX_INTERVAL_STEPS = 10_000_000
#: Upper bound of ``full_warm_up_rounds``.
MAX_WARM_UP_STEPS = 10_000_000
#: Upper bound of ``weight_decay``: AdamW multiplies the weights by (1 - lr * weight_decay) each step.
MAX_WEIGHT_DECAY = 10.0
#: Upper bound of ``max_grad_norm`` (a larger threshold never clips; give null to disable clipping).
MAX_GRAD_NORM = 1e6

#: The former spelling of the two run-time window policies (``update_interval: "adaptive"``,
#: ``select_interval: "epoch"``), still accepted.
_POLICY_ALIASES = {"update_interval": "adaptive", "select_interval": "epoch"}


class EngineKnobs(BaseModel):
    """The engine settings a job may give that have one value whatever the machine: AdamW's and zenflow's.
    Each default is defined here only (the engine's and a job's alike)."""

    # use_attribute_docstrings: each field's docstring is its description in the JSON schema (OpenAPI).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, use_attribute_docstrings=True)

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's decay rates of the first and second moments; torch.optim.AdamW's defaults."""
    eps: float = Field(1e-8, gt=0, le=1.0)
    """AdamW's term added to the denominator for stability; torch.optim.AdamW's default."""
    weight_decay: float = Field(0.0, ge=0, le=MAX_WEIGHT_DECAY)
    """Decoupled weight decay (times ``1 - lr * weight_decay`` per step); off unless asked for."""
    max_grad_norm: float | None = Field(1.0, gt=0, le=MAX_GRAD_NORM)
    """Global gradient-norm clipping over the device and the CPU part (null: off); 1.0, the usual LM value."""
    topk_ratio: float = Field(0.1, gt=0, le=1)
    """zenflow: fraction of each 2-D weight's columns updated on the device every step; the ZenFlow paper's 0.1."""
    update_interval: int | Literal["adaptive"] = 4
    """zenflow: steps per window (one CPU step of the other columns each); "adaptive": each window ends
    once the unselected gradient's mass reaches the selected one's (at most ``max_update_interval``
    steps). The paper's 4."""
    select_interval: int | Literal["epoch"] = "epoch"
    """zenflow: steps between column reselections (at least ``update_interval``); "epoch": at each new
    epoch, as the paper does."""
    full_warm_up_rounds: int = Field(0, ge=0, le=MAX_WARM_UP_STEPS)
    """zenflow: first steps that update everything synchronously on the CPU, selecting nothing; none, as the paper."""
    max_update_interval: int = Field(16, ge=1, le=MAX_INTERVAL_STEPS)
    """zenflow: longest "adaptive" window, so staleness stays bounded; four windows of the default length."""
    overlap_step: bool = True
    """zenflow: run each window's CPU step in the background and apply it a window later (true), or wait for
    it at the window's end and apply it at once (false: no staleness, the CPU step is stall)."""
    scale_cpu_lr: bool = False
    """zenflow: the CPU step's learning rate is the window's summed rates (true) or the boundary's (false:
    DeepSpeed's; converges better)."""
    host_moments: HostMoments = "fp32"
    """offload and zenflow: the dtype of the CPU optimizer's two moments, the master weights staying fp32.
    bf16: 8 instead of 12 host bytes per offloaded parameter and 20 instead of 28 bytes moved per CPU
    update (computed in fp32, rounded back stochastically); fp32 until measured beyond the convergence
    benchmark's small base, where bf16 came within 1% of fp32's validation loss (docs/engine-tuning.md)."""

    @model_validator(mode="before")
    @classmethod
    def _policy_aliases(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and any(raw.get(k) == "auto" for k in _POLICY_ALIASES):
            return {
                k: (_POLICY_ALIASES[k] if k in _POLICY_ALIASES and v == "auto" else v) for k, v in raw.items()
            }
        return raw

    @field_validator(
        "update_interval", "select_interval", "full_warm_up_rounds", "max_update_interval", mode="before"
    )
    @classmethod
    def _no_bool(cls, v: object) -> object:
        # bool is an int subclass: True would silently become an interval of 1.
        if isinstance(v, bool):
            raise ValueError("must be an integer, not a boolean")
        return v

    @field_validator("update_interval", "select_interval")
    @classmethod
    def _interval(cls, v: int | str, info: ValidationInfo) -> int | str:
        if isinstance(v, int) and not 1 <= v <= MAX_INTERVAL_STEPS:
            policy = _POLICY_ALIASES[info.field_name or "update_interval"]
            raise ValueError(f"must be an integer in [1, {MAX_INTERVAL_STEPS}] or '{policy}'")
        # update_interval is declared first, so it is validated (and in info.data) by now.
        window = info.data.get("update_interval")
        if (
            info.field_name == "select_interval"
            and isinstance(v, int)
            and isinstance(window, int)
            and v < window
        ):
            raise ValueError("must be >= update_interval")
        return v

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError("each must be in [0, 1)")
        return v


class EngineRequest(EngineKnobs):
    """``engine`` of a job: the public engine settings. ``mode``, ``accumulate_on`` and ``shard_params``
    also take ``auto``: the job's plan for the machine decides (trainer.resolve); the job object then shows
    the value and its source."""

    mode: Literal[EngineMode, Auto] = "auto"
    """device: AdamW on the device; offload: the CPU AdamW every step, the device waiting; zenflow: the
    important columns on the device every step, the rest on the CPU in the background; auto: the fastest
    mode that fits the machine by the plan's prediction (device unless another is predicted 5% faster)."""
    accumulate_on: Literal[Accumulator, Auto] = DEFAULT_ACCUMULATOR
    """Where zenflow sums a window's unselected gradient: host (no device memory), device (an fp32
    accumulator on the device, less CPU work per step), or auto: the fastest that fits by the plan."""
    shard_params: bool | Auto = "auto"
    """Shard the weights, gradients and optimizer state over the job's ranks with PyTorch FSDP2, each rank
    holding 1/N (true), or keep a whole copy of the weights on every rank (false); auto: sharded when the
    plan finds that replicated weights do not fit the device. One rank never shards."""


class ResolvedEngine(EngineKnobs):
    """The engine settings a job runs with: every value concrete."""

    mode: EngineMode
    accumulate_on: Accumulator
    shard_params: bool
    """The weights are row-sharded over the ranks (FSDP2)."""
    landing_buffers: bool
    """zenflow on CUDA: a device copy of the split weights receives each window's CPU result ahead of the
    merge; the plan drops it when the job only fits without it."""

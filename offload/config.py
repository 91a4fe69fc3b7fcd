"""Validated settings of the offload engine."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

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
    # Run the CPU window update in the background, its result applied one window later (True), or at the
    # window end with the training thread waiting for it and its result applied at once (False: no
    # staleness, DeepSpeed's default).
    overlap_step: bool = True

    # --- extensions (not in the original contract; defaults keep the documented behaviour) ---
    # select_interval="auto" reselects when the caller signals a new epoch (engine.new_epoch()); a caller
    # that never does gets a reselection every this many steps instead.
    select_interval_fallback: int = Field(100, ge=1, le=MAX_INTERVAL_STEPS)
    # CPU cores the engine plans its split with; None = the cores this process may run on.
    cpu_threads: int | None = Field(None, ge=1, le=MAX_CPU_THREADS)
    # Core placement (offload.placement; Linux, where the host allows it): zenflow's CPU optimizer worker
    # and the training thread on disjoint physical cores (hyperthread siblings together), and on a host
    # with several GPUs each GPU's process on its own share of the cores, NUMA-local to its GPU. False:
    # the engine changes no thread's CPU affinity (the off switch).
    bind_worker_cores: bool = True
    # zenflow: the learning rate of the CPU's once-per-window AdamW step on the window-mean gradient. False
    # (default, DeepSpeed's rule): the boundary's plain lr (gradient-accumulation semantics: the unselected
    # weights move more slowly than the selected ones). True: the sum of the window's per-step learning
    # rates (the linear scaling rule: lr * window length at a constant lr). Fine-tuning a pretrained model
    # (python -m bench.convergence --seeds 0,1,2,3 --scale-cpu-lr), the summed lr ends at 1.25x (window 4)
    # and 1.35x (window 8) device mode's validation loss, the plain one at 1.006x and 0.998x: a full-size
    # step that lands a window late overshoots (Adam's step on a window mean is also larger than the
    # per-step ones it replaces, the mean's noise being smaller).
    scale_cpu_lr: bool = False
    # Where zenflow accumulates the unselected gradient over a window: "host" = the worker streams every
    # step's gradient off the device (through a fixed two-slot ring on CUDA) and adds it, in fp32, into a
    # host accumulator in the parameters' dtype (no extra device memory; two accumulators: 16 host
    # bytes/param with bf16 params, see offload.memory); "device" = an fp32 accumulator on the device (+4
    # device bytes/param, reported as device_buffer_bytes), copied to the host, rounded to the parameters'
    # dtype, once per window (14 host bytes/param; CPU work per step is then only the window's AdamW /
    # window length).
    accumulate_on: Literal["host", "device"] = "host"
    # Largest slice (elements) the CPU optimizer updates before it lets waiting gradient copies run.
    cpu_chunk_elements: int = Field(1 << 23, ge=1024, le=MAX_CHUNK_ELEMENTS)
    # fp16 parameters: dynamic loss scaling with torch.amp.GradScaler's rule (the caller backpropagates
    # engine.scale_loss(loss); the step unscales before clipping; a skipped step multiplies the scale by
    # the backoff factor, growth_interval finite steps in a row by the growth factor). "auto": on exactly
    # when a trainable parameter is fp16; "dynamic": always; "off": never (fp16 gradients may underflow).
    loss_scaling: Literal["auto", "dynamic", "off"] = "auto"
    loss_scale_init: float = Field(2.0**16, gt=0, le=2.0**64)
    loss_scale_growth_factor: float = Field(2.0, gt=1, le=1e3)
    loss_scale_backoff_factor: float = Field(0.5, gt=0, lt=1)
    loss_scale_growth_interval: int = Field(2000, ge=1, le=MAX_INTERVAL_STEPS)

    @field_validator(
        "update_interval",
        "select_interval",
        "full_warm_up_rounds",
        "max_update_interval",
        "select_interval_fallback",
        "cpu_threads",
        "cpu_chunk_elements",
        "loss_scale_growth_interval",
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

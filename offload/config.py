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

    # use_attribute_docstrings: each field's docstring is its description in the JSON schema (OpenAPI).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, use_attribute_docstrings=True)

    mode: EngineMode = "zenflow"
    """How parameters are updated (above); zenflow, what the engine is for (jobs' "auto" may pick device)."""
    lr: float = Field(1e-4, gt=0)
    """AdamW's learning rate at the start (``engine.set_lr`` drives it per step); a usual fine-tuning lr."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's decay rates of the first and second moments; torch.optim.AdamW's defaults."""
    eps: float = Field(1e-8, gt=0, le=1.0)
    """AdamW's term added to the denominator for stability; torch.optim.AdamW's default."""
    weight_decay: float = Field(0.0, ge=0, le=MAX_WEIGHT_DECAY)
    """Decoupled weight decay (times ``1 - lr * weight_decay`` per step); off unless asked for."""
    max_grad_norm: float | None = Field(1.0, gt=0, le=MAX_GRAD_NORM)
    """Global gradient-norm clipping over the device and the CPU part (None: off); 1.0, the usual LM value."""

    # ZenFlow knobs (ignored by the other modes).
    topk_ratio: float = Field(0.1, gt=0, le=1)
    """Fraction of each 2-D weight's columns updated on the device every step; the ZenFlow paper's 0.1."""
    update_interval: int | Literal["auto"] = 4
    """Steps per window (one CPU step of the other columns each), or "auto"; the paper's 4."""
    select_interval: int | Literal["auto"] = "auto"
    """Steps between column reselections, or "auto": at each new epoch, as the paper does."""
    full_warm_up_rounds: int = Field(0, ge=0, le=MAX_WARM_UP_STEPS)
    """First steps that update everything synchronously on the CPU, selecting nothing; none, as the paper."""
    max_update_interval: int = Field(16, ge=1, le=MAX_INTERVAL_STEPS)
    """Longest "auto" window, so staleness stays bounded; 16, four windows of the default length."""
    cpu_optimizer_cores_ratio: float = Field(0.5, gt=0, le=1)
    """Share of the process's CPU cores given to the CPU optimizer thread (offload.cores); an even split."""
    overlap_step: bool = True
    """Run each window's CPU step in the background and apply it a window later (True), or wait for it at
    the window's end and apply it at once (False: no staleness, the CPU step is stall; DeepSpeed's default)."""

    # --- extensions (not in the original contract; defaults keep the documented behaviour) ---
    select_interval_fallback: int = Field(100, ge=1, le=MAX_INTERVAL_STEPS)
    """select_interval "auto" if the caller never calls ``engine.new_epoch()``: reselect this often."""
    cpu_threads: int | None = Field(None, ge=1, le=MAX_CPU_THREADS)
    """CPU cores the engine plans its split with; None: the cores this process may run on."""
    bind_worker_cores: bool = True
    """Pin the CPU optimizer thread and the training thread to disjoint physical cores, and on a host with
    several GPUs each GPU's process to its own NUMA-local share (offload.placement, Linux); False: the
    engine changes no thread's CPU affinity."""
    scale_cpu_lr: bool = False
    """CPU step lr: the window's summed lrs, or the boundary's (False: DeepSpeed's; converges better)."""
    accumulate_on: Literal["host", "device"] = "host"
    """Where zenflow sums a window's unselected gradient: "host" (streamed off the device every step, no
    device memory) or "device" (an fp32 accumulator on the device, copied to the host once per window:
    less CPU work per step for 4 device bytes per parameter); bytes per mode in docs/engine-tuning.md."""
    landing_buffers: bool = True
    """zenflow on CUDA, one process: prefetch each window's CPU result into a device copy of the split
    weights, so the merge is a device copy (True; 2 B per split element in bf16). False, for jobs whose
    device memory cannot hold that copy: the merge uploads the result from page-locked host memory at the
    window's end, the GPU waiting for the upload. In a process group the gathered replica is kept anyway."""
    cpu_chunk_elements: int = Field(1 << 23, ge=1024, le=MAX_CHUNK_ELEMENTS)
    """Largest slice the CPU step updates before waiting gradient copies run (2**23: a 32 MiB bf16 ring)."""
    shard_params: bool = False
    """The model's parameters are row-sharded by PyTorch FSDP2 (``fully_shard``; :mod:`offload.fsdp`): each rank
    updates its own rows and its host state is sized to them. False: whole parameters on every rank."""
    loss_scaling: Literal["auto", "dynamic", "off"] = "auto"
    """Dynamic loss scaling with GradScaler's rule; "auto": on exactly when a trainable parameter is fp16."""
    loss_scale_init: float = Field(2.0**16, gt=0, le=2.0**64)
    """The first loss scale; torch.amp.GradScaler's default."""
    loss_scale_growth_factor: float = Field(2.0, gt=1, le=1e3)
    """Scale multiplier after ``loss_scale_growth_interval`` finite steps in a row; GradScaler's default."""
    loss_scale_backoff_factor: float = Field(0.5, gt=0, lt=1)
    """Scale multiplier after a skipped (non-finite) step; GradScaler's default."""
    loss_scale_growth_interval: int = Field(2000, ge=1, le=MAX_INTERVAL_STEPS)
    """Finite steps in a row before the scale grows; GradScaler's default."""

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

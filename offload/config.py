"""Validated settings of the offload engine: :class:`EngineConfig`.

Its zenflow and AdamW knobs, with their defaults and bounds, are the job contract's
(:class:`contract.engine.EngineKnobs`: a job may set them, and the engine has the same defaults); the
choices a job's plan makes (``mode``, ``accumulate_on``, ``shard_params``, ``landing_buffers``) and the
learning rate are set by whoever builds the engine; the rest (:data:`TUNING_FIELDS`) are a worker's
tuning of its machine, never a job's (``ZENFLOW_ENGINE_TUNING``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from contract.engine import DEFAULT_ACCUMULATOR, MAX_INTERVAL_STEPS, Accumulator, EngineKnobs, EngineMode

#: Upper bound of ``cpu_threads`` and of ``cpu_chunk_elements``.
MAX_CPU_THREADS = 4096
MAX_CHUNK_ELEMENTS = 1 << 31


class EngineConfig(EngineKnobs):
    """How the engine updates parameters.

    ``device``: plain AdamW on the device. ``offload``: synchronous ZeRO-Offload style (CPU AdamW
    every step, the device waits). ``zenflow``: top-k columns on the device every step, the rest
    accumulated and applied by the CPU optimizer in the background, one window stale.

    All fields are validated on construction; a bad value raises ``pydantic.ValidationError`` whose
    message names the field (e.g. ``topk_ratio: must be in (0, 1]``). Every number is bounded above
    and finite (NaN and infinities are refused), so no value can overflow a counter or only fail
    once training runs.
    """

    mode: EngineMode = "zenflow"
    """How parameters are updated (above); zenflow, what the engine is for."""
    lr: float = Field(1e-4, gt=0)
    """AdamW's learning rate at the start (``engine.set_lr`` drives it per step); a usual fine-tuning lr."""
    accumulate_on: Accumulator = DEFAULT_ACCUMULATOR
    """Where zenflow sums a window's unselected gradient: "host" (streamed off the device every step, no
    device memory) or "device" (an fp32 accumulator on the device, copied to the host once per window:
    less CPU work per step for 4 device bytes per parameter); bytes per mode in docs/engine-tuning.md."""
    shard_params: bool = False
    """The model's parameters are row-sharded by PyTorch FSDP2 (``fully_shard``; :mod:`offload.fsdp`): each rank
    updates its own rows and its host state is sized to them. False: whole parameters on every rank."""
    landing_buffers: bool = True
    """zenflow on CUDA, one process: prefetch each window's CPU result into a device copy of the split
    weights, so the merge is a device copy (True; 2 B per split element in bf16). False, for jobs whose
    device memory cannot hold that copy: the merge uploads the result from page-locked host memory at the
    window's end, the GPU waiting for the upload. In a process group the gathered replica is kept anyway."""

    # --- a worker's tuning (TUNING_FIELDS): never a job's -------------------------------------------
    cpu_optimizer_cores_ratio: float = Field(0.5, gt=0, le=1)
    """Share of the process's CPU cores given to the CPU optimizer thread (offload.cores); an even split."""
    select_interval_fallback: int = Field(100, ge=1, le=MAX_INTERVAL_STEPS)
    """select_interval "epoch" if the caller never calls ``engine.new_epoch()``: reselect this often."""
    cpu_threads: int | None = Field(None, ge=1, le=MAX_CPU_THREADS)
    """CPU cores the engine plans its split with; None: the cores this process may run on."""
    bind_worker_cores: bool = True
    """Pin the CPU optimizer thread and the training thread to disjoint physical cores, and on a host with
    several GPUs each GPU's process to its own NUMA-local share (offload.placement, Linux); False: the
    engine changes no thread's CPU affinity."""
    cpu_chunk_elements: int = Field(1 << 23, ge=1024, le=MAX_CHUNK_ELEMENTS)
    """Largest slice the CPU step updates before waiting gradient copies run (2**23: a 32 MiB bf16 ring)."""
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
        "select_interval_fallback",
        "cpu_threads",
        "cpu_chunk_elements",
        "loss_scale_growth_interval",
        mode="before",
    )
    @classmethod
    def _no_bool_tuning(cls, v: object) -> object:
        if isinstance(v, bool):
            raise ValueError("must be an integer, not a boolean")
        return v


#: The fields a worker tunes for its machine and its jobs never set (``ZENFLOW_ENGINE_TUNING``).
TUNING_FIELDS: tuple[str, ...] = (
    "cpu_optimizer_cores_ratio",
    "select_interval_fallback",
    "cpu_threads",
    "bind_worker_cores",
    "cpu_chunk_elements",
    "loss_scaling",
    "loss_scale_init",
    "loss_scale_growth_factor",
    "loss_scale_backoff_factor",
    "loss_scale_growth_interval",
)


def check_tuning(values: dict[str, object]) -> None:
    """Raise ValueError naming the field when ``values`` is not a valid engine tuning: fields of
    :data:`TUNING_FIELDS` only, each within its bounds."""
    unknown = sorted(set(values) - set(TUNING_FIELDS))
    if unknown:
        raise ValueError(
            f"not engine tuning fields: {', '.join(unknown)} (they are: {', '.join(TUNING_FIELDS)})"
        )
    EngineConfig.model_validate(values)  # a ValidationError (a ValueError) naming the field

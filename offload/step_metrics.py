"""Per-step measurements out of the engine: a plain record, no Prometheus dependency."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class StepMetrics:
    step: int
    #: Host wall time of the whole training step, from the end of the previous engine.step() (the
    #: engine's construction, or a flush or load) to the end of this one.
    wall_seconds: float
    #: wall minus stall: the time the device (a CPU-only run: the training thread) was working.
    compute_seconds: float
    #: Time the device waited. CUDA: its idle time measured with CUDA timing events, namely the gap
    #: from the end of the previous step's queued work to the start of this step's device work
    #: (``engine.begin_step()``) plus every section in which step() blocked the training thread
    #: (on the CPU optimizer, transfers, a window's merge or reselection; device work queued inside
    #: such a section counts too). An interval still running on the device when step() returns is
    #: counted in the next step, and at most ``wall_seconds`` is counted per step (the rest carries
    #: over), so sums over a run are exact. CPU-only run: the time step() blocked the training
    #: thread on the CPU optimizer or on transfers.
    stall_seconds: float
    #: Time the CPU optimizer spent on the update that finished (or ran) during this step.
    cpu_optimizer_seconds: float
    bytes_device_to_host: int
    bytes_host_to_device: int
    #: Device bytes held by optimizer state (moments, selected-column moments, index buffers).
    device_optimizer_state_bytes: int
    #: Whether a CPU window update was applied to the device params at this step.
    applied_cpu_update: bool = False
    #: Total gradient norm before clipping (None when not computed).
    grad_norm: float | None = None
    lr: float = 0.0
    #: Engine mode that produced the record ("device", "offload" or "zenflow").
    mode: str = ""
    #: Device bytes of transfer landing buffers (zenflow on CUDA), kept apart from optimizer state.
    device_buffer_bytes: int = 0
    #: Whether this step ran as a synchronous full update (offload mode, zenflow warm-up).
    synchronous: bool = False
    #: Whether the step was skipped because its global gradient norm was not finite (nothing was
    #: updated, accumulated or counted; see offload.guard).
    skipped: bool = False
    #: The fp16 loss scale this step's gradients were unscaled by (None without loss scaling).
    loss_scale: float | None = None
    #: Host bytes the engine holds (page-locked on CUDA): fp32 master and moments, gradient
    #: accumulators and transfer buffers (see offload.memory); fixed for the engine's life.
    host_bytes: int = 0
    #: Ranks of the engine's process group and this record's rank (1 and 0 in a single process).
    world_size: int = 1
    rank: int = 0
    #: Bytes this rank sent for gradient reductions this step (all-reduce, reduce-scatter; ring
    #: algorithms: offload.collectives.wire_bytes).
    bytes_reduced: int = 0
    #: Bytes this rank sent for the all-gathers of updated optimizer shards this step (ring).
    bytes_gathered: int = 0
    #: Whether the parameters are row-sharded over the ranks (FSDP2, offload.fsdp), and the bytes of the
    #: trainable parameters this rank holds between steps (its rows when sharded, else whole ones).
    sharded: bool = False
    param_bytes: int = 0

    @property
    def stall_fraction(self) -> float:
        """stall / wall: on CUDA the share of the step the device sat idle."""
        return self.stall_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def utilization(self) -> float:
        """Share of the step the device spent working rather than waiting (1 - stall_fraction)."""
        return 1.0 - self.stall_fraction

    def as_dict(self) -> dict[str, float | int | bool | None]:
        d = asdict(self)
        d["stall_fraction"] = self.stall_fraction
        return d

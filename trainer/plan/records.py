"""What a plan says: :class:`Plan`, the choices it makes (:class:`PlanChoices`), each engine mode's
estimate (:class:`ModeEstimate`) and what keeps a job from fitting (:class:`Problem`)."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

from contract.engine import ENGINE_MODES, Accumulator, EngineMode
from trainer.plan.gpus import Machine, format_bytes

__all__ = ["ENGINE_MODES", "Accumulator", "EngineMode", "ModeEstimate", "Plan", "PlanChoices", "Problem"]


class Problem(NamedTuple):
    """Why the plan does not fit: the field to change (``("engine", "accumulate_on")``) and why."""

    loc: tuple[str, ...]
    message: str


class PlanChoices(BaseModel):
    """The settings a run would use on the machine: the job's own values and the plan's choices."""

    model_config = ConfigDict(frozen=True)

    mode: EngineMode
    micro_batch_size: int
    gradient_checkpointing: bool
    packing: bool
    accumulate_on: Accumulator
    #: The engine's window: steps, or ``adaptive`` (the step time assumes the shortest that hides the CPU work).
    update_interval: int | Literal["adaptive"]
    #: Weights, gradients and optimizer state sharded across the job's ranks (FSDP2; ``engine.shard_params``).
    shard_params: bool = False
    #: zenflow's device copy of the split weights (``EngineConfig.landing_buffers``).
    landing_buffers: bool = True


class ModeEstimate(BaseModel):
    """One engine mode's best configuration on the machine."""

    model_config = ConfigDict(frozen=True)

    fits: bool
    settings: PlanChoices
    device_bytes: int
    host_bytes: int
    step_seconds: float
    tokens_per_second: float
    gpu_seconds: float
    pcie_seconds: float
    cpu_seconds: float
    bound: str
    #: zenflow: the window length the step time assumes.
    update_interval: int | None = None
    #: Sharded weights: FSDP's collectives per step over the GPU interconnect (overlapped with compute).
    interconnect_seconds: float = 0.0
    #: A reinforcement job: the rollout's sampling per step (in ``step_seconds``).
    generation_seconds: float = 0.0


class Plan(BaseModel):
    """Whether a job fits a machine, its memory per component, its settings and predicted speed."""

    model_config = ConfigDict(frozen=True)

    fits: bool
    model: str
    machine: Machine
    params: int
    trainable_params: int
    dtype: Literal["float32", "bfloat16"]
    batch_size: int
    max_seq_length: int
    tokens_per_step: int
    settings: PlanChoices
    #: Device memory the plan may use (the GPU's memory less the device reserve; usable host memory on
    #: a CPU machine).
    device_capacity_bytes: int
    #: Host memory the plan may use (the host's memory less the host reserve).
    host_capacity_bytes: int
    #: What the plan leaves free: on the device for the allocator and workspaces, on the host for the
    #: OS, the driver and the page cache (trainer.plan.candidates: DEVICE_MARGIN, HOST_RESERVE_*).
    device_reserve_bytes: int = 0
    host_reserve_bytes: int = 0
    #: One rank's device and host bytes (the whole job's host: :attr:`host_bytes_all_ranks`).
    device_bytes: int
    host_bytes: int
    #: The job's ranks (``resources``: nodes x gpus) and the host bytes of all of them.
    ranks: int = 1
    host_bytes_all_ranks: int = 0
    #: ``shard_params`` is true because the replicated weights do not fit (``auto``) or would not (set
    #: true): the job fits with sharded weights only.
    fits_only_sharded: bool = False
    #: Per component: weights, gradients, optimizer_state, landing_buffers, accumulator, engine_scratch,
    #: activations, runtime, with sharded weights gather_buffers and reduce_scatter_buffer (device); engine_state, engine_accumulators, engine_transfer, model_loading,
    #: checkpoint (what writing one adds: trainer.plan.candidates.checkpoint_bytes), data, process
    #: (host). On a CPU machine the device components are counted in host_bytes too.
    device: dict[str, int]
    host: dict[str, int]
    activations: dict[str, int]
    step_seconds: float
    tokens_per_second: float
    #: A reinforcement job: the rollout's sampling per step (in ``step_seconds``) and its KV cache.
    generation_seconds: float = 0.0
    rollout_cache_bytes: int = 0
    #: Per engine mode: its best configuration, whether it fits, predicted step time.
    modes: dict[EngineMode, ModeEstimate]
    #: Why these settings (one sentence each).
    reasons: list[str]
    problems: list[Problem]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: problems as ``{"loc": [...], "message": ...}``."""
        d = self.model_dump(mode="json")
        d["problems"] = [{"loc": list(p.loc), "message": p.message} for p in self.problems]
        return d

    def summary(self) -> str:
        """One line for the job's events."""
        s = self.settings
        fit = "fits" if self.fits else "does not fit"
        return (
            f"Plan: {fit} on {self.machine.gpu_name}: {s.mode} mode, micro-batch {s.micro_batch_size}, "
            f"checkpointing {'on' if s.gradient_checkpointing else 'off'}, "
            f"{'sharded' if s.shard_params else 'replicated'} weights over {self.ranks} rank(s), device {format_bytes(self.device_bytes)} "
            f"of {format_bytes(self.device_capacity_bytes)}, host {format_bytes(self.host_bytes)} of "
            f"{format_bytes(self.host_capacity_bytes)}, ~{self.step_seconds:.3g} s/step{self._rollout()}"
        )

    def _rollout(self) -> str:
        if not self.generation_seconds:
            return ""
        return (
            f" (sampling ~{self.generation_seconds:.3g} s of it, KV cache "
            f"{format_bytes(self.rollout_cache_bytes)})"
        )

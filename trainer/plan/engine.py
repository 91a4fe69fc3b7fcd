"""The engine's memory per mode, for the plan: the engine's own byte formulas
(:func:`offload.memory.engine_memory`: what ``ZenFlowEngine`` allocates, per component) for the
job's trainable weights, regrouped into the plan's components.

Device: ``optimizer_state`` (moments, fp32 masters, step counts, selected columns' state),
``landing_buffers`` (zenflow on CUDA: the CPU result prefetched per split weight),
``accumulator`` (zenflow with ``accumulate_on="device"``) and ``engine_scratch`` (reselection stash,
gathered column gradients). Host (page-locked on CUDA): ``engine_state`` (fp32 master, moments in ``host_moments``),
``engine_accumulators`` (zenflow's window gradients), ``engine_transfer`` (gradient landing or
streaming ring). Importing this module does not import torch (offload.memory does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from contract.engine import Accumulator, EngineKnobs, EngineMode
from offload.config import EngineConfig
from trainer.plan.shapes import Weight

_HOST_PARTS = {
    "master": "engine_state",
    "exp_avg": "engine_state",
    "exp_avg_sq": "engine_state",
    "accumulators": "engine_accumulators",
    "gradient": "engine_transfer",
    "transfer": "engine_transfer",
}
_DEVICE_BUFFERS = {"landing": "landing_buffers", "accumulator": "accumulator"}


@dataclass(frozen=True)
class EngineBytes:
    """Bytes per plan component (see the module doc)."""

    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    #: Trainable parameters the CPU optimizer updates (offload: all; zenflow: the split weights).
    host_params: int = 0

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


def _add(out: dict[str, int], key: str, value: int) -> None:
    if value:
        out[key] = out.get(key, 0) + value


def engine_config(
    knobs: EngineKnobs, mode: EngineMode, accumulate_on: Accumulator, *, landing: bool = True
) -> EngineConfig:
    """The engine's config the plan counts bytes with: the job's knobs in ``mode``."""
    return EngineConfig(**knobs.model_dump(), mode=mode, accumulate_on=accumulate_on, landing_buffers=landing)


def engine_bytes(
    config: EngineConfig, weights: Sequence[Weight], dtype_bytes: int, *, cuda: bool = True
) -> EngineBytes:
    """The engine's bytes for trainable ``weights`` of ``dtype_bytes`` under ``config`` (its mode,
    ``topk_ratio``, ``accumulate_on``, ...)."""
    import torch

    from offload.memory import engine_memory, is_split

    dtype = torch.bfloat16 if dtype_bytes == 2 else torch.float32
    mem = engine_memory([w.shape for w in weights], dtype, config, device_type="cuda" if cuda else "cpu")
    device = {"optimizer_state": mem.device_state_bytes}
    for k, v in mem.device_buffers.items():
        _add(device, _DEVICE_BUFFERS.get(k, "engine_scratch"), v)
    host: dict[str, int] = {}
    for k, v in mem.host.items():
        _add(host, _HOST_PARTS.get(k, "engine_transfer"), v)
    if config.mode == "offload":
        host_params = mem.params
    elif config.mode == "zenflow":
        host_params = sum(w.numel for w in weights if is_split(w.shape, config.topk_ratio))
    else:
        host_params = 0
    return EngineBytes(device=device, host=host, host_params=host_params)

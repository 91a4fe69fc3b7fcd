"""Bytes the engine holds, per mode and component: pure arithmetic over parameter shapes (no allocation).

The layout below is what :mod:`offload.host`, :mod:`offload.offload_mode` and
:mod:`offload.zenflow.mode` allocate; ``ZenFlowEngine.memory()`` measures the same components from the
real tensors (``tests/offload/test_engine_memory.py`` holds the two equal). ``g`` is the parameter dtype's
size (2 for bf16/fp16, 4 for fp32); "offloaded" elements are all trainable ones in ``offload`` mode
and the split weights' in ``zenflow`` (2-D weights with fewer selected than total columns).

Host (page-locked on CUDA), bytes per offloaded element:

- ``master``: fp32, 4; ``exp_avg``, ``exp_avg_sq``: 4 each, or 2 each with ``host_moments="bf16"``
  (12 or 8 in all).
- ``gradient`` (``offload``): ``g``. The gradient lands here; the CPU step reads it and writes the new
  bf16/fp16 parameter over it in the same pass (for fp32 parameters the master itself goes back), so
  one buffer is both the gradient landing and the parameter staging.
- ``accumulators`` (``zenflow``): window-mean gradients in the parameter dtype, fp32 (4) for fp16
  parameters, whose loss-unscaled means would underflow in fp16 (summed in fp32, rounded once per
  step), two with ``accumulate_on="host"`` (the CPU step reads window ``v``'s while ``v + 1``
  fills the other), one with ``"device"`` (filled from the device's fp32 accumulator once per window).
  The CPU step writes the new bf16/fp16 parameters over (fp16: into the first half of) the
  accumulator it consumed; the warm-up's
  synchronous steps land their gradients in accumulator 0.
- ``transfer`` (``zenflow``, ``accumulate_on="host"`` on CUDA only): a ring of two slots of
  ``min(split elements, cpu_chunk_elements)`` elements in the parameter dtype, through which the CPU
  optimizer thread streams each step's gradient into the accumulator (a fixed 32 MiB with bf16 by
  default, whatever the model's size). On a CPU device the thread reads the gradients where they are.

So with bf16 parameters: ``offload`` 14 B, ``zenflow`` 16 B (host accumulation, plus the fixed ring
on CUDA) or 14 B (device accumulation) per offloaded element; with fp16 14, 20 and 16; with fp32
parameters 16, 20 and 16; each 4 B less with ``host_moments="bf16"``.

Device, beyond the model's weights and gradients:

- ``device_state``: ``device`` mode: fp32 moments (8 B/element), an fp32 master for bf16/fp16 (4) and a
  4-byte step count per tensor. ``zenflow``: the same for the params it owns whole, and for the split
  weights per selected element 8 (+4 fp32 master for bf16/fp16) plus 16 B per selected column (its
  index and step count, int64).
- ``device_buffers`` (``zenflow``): ``landing`` (CUDA with ``landing_buffers``: the CPU result is
  prefetched into one buffer per split weight, ``g`` B/element; without, the merge uploads it from host
  memory), ``accumulator`` (``accumulate_on="device"``: fp32, 4 B/element),
  ``stash`` (from a reselection to the next window end: the dropped columns' fp32 values, 4 B per
  selected element) and ``column_scratch`` (gathered selected-column gradients in fp32 plus a buffer in
  the parameter dtype, or an fp32 work copy for fp32 weights: 4 + g or 8 B per selected element).

Not counted: with host accumulation the CPU thread holds each step's split gradients (the model's own
``.grad`` tensors, ``g`` B/element on the device) until it has streamed them to the host, each one
released as soon as its last chunk is copied (normally within the next forward pass); a reselection gathers the new columns' fp32
master values in transient host memory (4 B per selected element) for the upload.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from contract.engine import HOST_MOMENT_BYTES
from offload.config import EngineConfig
from offload.selection import num_selected

_LOW = (torch.bfloat16, torch.float16)


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def is_split(shape: Sequence[int], topk_ratio: float) -> bool:
    """Whether zenflow splits a weight of ``shape`` (device columns + host rest)."""
    return len(shape) == 2 and num_selected(int(shape[1]), topk_ratio) < int(shape[1])


@dataclass(frozen=True, slots=True)
class EngineMemory:
    """Bytes by component: ``host`` (page-locked on CUDA), ``device_state`` (optimizer state) and
    ``device_buffers`` (transfer and scratch buffers); ``params`` counts the trainable elements."""

    mode: str
    params: int
    host: dict[str, int] = field(default_factory=dict)
    device_state: dict[str, int] = field(default_factory=dict)
    device_buffers: dict[str, int] = field(default_factory=dict)

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    @property
    def device_state_bytes(self) -> int:
        return sum(self.device_state.values())

    @property
    def device_buffer_bytes(self) -> int:
        return sum(self.device_buffers.values())

    @property
    def host_bytes_per_param(self) -> float:
        return self.host_bytes / self.params if self.params else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "params": self.params,
            "host_bytes": self.host_bytes,
            "device_state_bytes": self.device_state_bytes,
            "device_buffer_bytes": self.device_buffer_bytes,
            "host_bytes_per_param": round(self.host_bytes_per_param, 4),
            "host": dict(self.host),
            "device_state": dict(self.device_state),
            "device_buffers": dict(self.device_buffers),
        }


def _dense_state(numel: int, tensors: int, low: bool) -> dict[str, int]:
    """fp32 moments, an fp32 master for bf16/fp16, and a 4-byte step count per tensor (device AdamW)."""
    return {
        "exp_avg": 4 * numel,
        "exp_avg_sq": 4 * numel,
        "master": 4 * numel if low else 0,
        "step": 4 * tensors,
    }


def _host_state(numel: int, config: EngineConfig) -> dict[str, int]:
    """The CPU optimizer's state: the fp32 master and the two moments (fp32 or bf16, ``host_moments``)."""
    m = HOST_MOMENT_BYTES[config.host_moments]
    return {"master": 4 * numel, "exp_avg": m * numel, "exp_avg_sq": m * numel}


def engine_memory(
    shapes: Iterable[Sequence[int]],
    dtype: torch.dtype,
    config: EngineConfig,
    *,
    device_type: str = "cuda",
) -> EngineMemory:
    """The bytes the engine holds for trainable parameters of ``shapes``, all of ``dtype``, in
    ``config.mode`` on a ``device_type`` ("cuda" or "cpu") device; see the module docstring."""
    shapes = [tuple(int(d) for d in s) for s in shapes]
    g = dtype_size(dtype)
    low = dtype in _LOW
    numels = [_numel(s) for s in shapes]
    total = sum(numels)
    cuda = device_type == "cuda"
    if config.mode == "device":
        return EngineMemory("device", total, device_state=_dense_state(total, len(shapes), low))
    if config.mode == "offload":
        return EngineMemory("offload", total, host=_host_state(total, config) | {"gradient": g * total})
    split = [(s, n) for s, n in zip(shapes, numels, strict=True) if is_split(s, config.topk_ratio)]
    full_numel = total - sum(n for _, n in split)
    n_split = sum(n for _, n in split)
    selected = sum(s[0] * num_selected(s[1], config.topk_ratio) for s, _ in split)
    columns = sum(num_selected(s[1], config.topk_ratio) for s, _ in split)
    on_device = config.accumulate_on == "device"
    host: dict[str, int] = {}
    if split:
        ring = 0 if on_device or not cuda else 2 * min(n_split, config.cpu_chunk_elements) * g
        host = _host_state(n_split, config) | {
            "accumulators": (1 if on_device else 2) * (4 if dtype == torch.float16 else g) * n_split,
            "transfer": ring,
        }
    state = _dense_state(full_numel, len(shapes) - len(split), low)
    state["exp_avg"] += 4 * selected
    state["exp_avg_sq"] += 4 * selected
    state["master"] += 4 * selected if low else 0
    state["columns"] = 16 * columns
    buffers = {
        "landing": g * n_split if cuda and config.landing_buffers else 0,
        "accumulator": 4 * n_split if on_device else 0,
        "stash": 4 * selected,
        "column_scratch": (4 + g if low else 8) * selected,
    }
    return EngineMemory("zenflow", total, host=host, device_state=state, device_buffers=buffers)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def merged(parts: Sequence[EngineMemory]) -> EngineMemory:
    """The sum of several :class:`EngineMemory` records of one mode (e.g. one per parameter dtype)."""

    def add(key: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in parts:
            for k, v in getattr(p, key).items():
                out[k] = out.get(k, 0) + v
        return out

    mode = parts[0].mode if parts else ""
    return EngineMemory(
        mode, sum(p.params for p in parts), add("host"), add("device_state"), add("device_buffers")
    )

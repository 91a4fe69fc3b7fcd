"""What every engine mode provides; the engine (:mod:`offload.engine`) times and reports around it."""

from __future__ import annotations

from typing import Any

import torch

from offload.collectives import EngineGroup, Reduced, average_gradients
from offload.config import EngineConfig
from offload.cpu_thread import CPUThread
from offload.device import DeviceOps
from offload.guard import Gate
from offload.memory import EngineMemory
from offload.timing import StepStats

NamedParams = list[tuple[str, torch.nn.Parameter]]


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def add_parts(parts: list[dict[str, int]]) -> dict[str, int]:
    """Component-wise sum of byte counts."""
    out: dict[str, int] = {}
    for p in parts:
        for k, v in p.items():
            out[k] = out.get(k, 0) + v
    return out


def to_cpu(obj: Any) -> Any:
    """A copy of a nested state structure with every tensor cloned to CPU (torch.save-able, unaliased)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_cpu(v) for v in obj)
    return obj


class Mode:
    """Base class; subclasses implement step, state_bytes, state_dict and load_state_dict."""

    name: str = ""
    #: The thread the mode runs its CPU optimizer on in the background (zenflow), if any.
    cpu_thread: CPUThread | None = None
    #: The group over which every parameter's rows are sharded (FSDP2, :mod:`offload.fsdp`): the mode's
    #: parameters are this rank's row blocks and what must be global (zenflow's column scores and "adaptive"
    #: window masses) is summed over it. None: the parameters are whole.
    row_group: Any = None

    def __init__(
        self, named: NamedParams, cfg: EngineConfig, ops: DeviceOps, ranks: EngineGroup | None = None
    ) -> None:
        self.named = named
        self.cfg = cfg
        self.ops = ops
        self.ranks = ranks if ranks is not None else EngineGroup()

    def reduce(self, stats: StepStats) -> Reduced:
        """Average the gradients across the process group's ranks (after
        :func:`~offload.collectives.fill_missing_gradients`), as far as this mode needs them; what the
        clipping scales. Default: all-reduce every gradient in place."""
        grads = [p.grad for _, p in self.named if p.grad is not None]
        stats.bytes_reduced += average_gradients(grads, self.ranks)
        return Reduced(grads)

    def step(self, stats: StepStats, lr: float, gate: Gate) -> None:
        """Update the parameters from their (already clipped) gradients; change nothing at all when
        ``gate`` says the step is skipped (see :mod:`offload.guard`)."""
        raise NotImplementedError

    def flush(self, stats: StepStats, lr: float) -> None:
        """Apply everything pending to the model now (nothing is pending in the synchronous modes)."""

    def check(self) -> None:
        """Raise a failure of the mode's CPU thread, if any."""

    def new_epoch(self) -> None:
        """The caller started a new epoch (zenflow reselects at the next window boundary)."""

    def state_bytes(self) -> int:
        """Device bytes held by optimizer state."""
        raise NotImplementedError

    def buffer_bytes(self) -> int:
        """Device bytes of transfer buffers (not optimizer state)."""
        return 0

    def memory(self) -> EngineMemory:
        """The bytes this mode holds, measured from its tensors (components as in :mod:`offload.memory`)."""
        raise NotImplementedError

    def params(self) -> int:
        return sum(p.numel() for _, p in self.named)

    def before_zero_grad(self) -> None:
        """The caller is about to zero the gradients in place: finish every read of them first."""

    def consolidated(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to("cpu", copy=True) for n, p in self.named}

    def device_params_state(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """The trainable parameters' values: CPU copies, or (``copy=False``) the parameters themselves."""
        return {n: p.detach().to("cpu", copy=True) if copy else p.detach() for n, p in self.named}

    def consolidated_one(self, name: str) -> torch.Tensor:
        """:meth:`consolidated`'s value of parameter ``name`` alone (a streamed export holds one copy
        at a time)."""
        return dict(self.named)[name].detach().to("cpu", copy=True)

    def load_device_params(self, sd: dict[str, torch.Tensor]) -> None:
        names = {n for n, _ in self.named}
        if set(sd) != names:
            missing, extra = sorted(names - set(sd)), sorted(set(sd) - names)
            raise ValueError(
                f"engine state does not match the model: missing {missing[:5]}, unexpected {extra[:5]}"
            )
        with torch.no_grad():
            for n, p in self.named:
                p.data.copy_(sd[n])

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """Everything for an identical continuation. ``copy=False``: the large tensors are the mode's
        own (device tensors on the device, host buffers), valid until the next step; for a writer that
        streams them (:mod:`offload.state_io`)."""
        raise NotImplementedError

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise NotImplementedError

    def load_shards(self, sds: list[dict[str, Any]]) -> None:
        """Load the states saved by every rank of a process group of another size (in rank order): the
        replicated parts from the first, the host optimizer shards re-cut. Default: nothing is sharded."""
        self.load_state_dict(sds[0])

    def close(self) -> None:
        """Release threads and host memory; idempotent."""

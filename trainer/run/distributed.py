"""One job as N data-parallel ranks: the rank's process group from the ``env://`` variables and the few
collectives the training loop needs (all of them no-ops, or the identity, without a group).

A launcher (the worker's, or ``torchrun``) starts one process per rank with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT set; a rank sees its GPU through CUDA_VISIBLE_DEVICES, so it
uses ``cuda:0`` (or ``cuda:LOCAL_RANK`` when every GPU of the node is visible to every rank). On CUDA
the group uses NCCL and the collectives take tensors on the rank's device; elsewhere gloo, CPU tensors.

Every rank must call the collectives here at the same points, in the same order (they block until all
ranks arrive); the loop therefore makes the same decisions on every rank (cancel, eval, checkpoint).
The loop's numbers (token counts, losses, the cancel vote) are host values and travel over a gloo
group of the same ranks (``DistContext.cpu_group``; the default group itself when that is gloo), so no
collective of the loop touches the device or waits for it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

__all__ = [
    "DistContext",
    "all_sum",
    "any_rank",
    "barrier",
    "broadcast_object",
    "init_from_env",
    "rank_device",
    "shutdown",
]

_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job's group of ranks."""

    rank: int
    world_size: int
    local_rank: int
    backend: str  # "nccl" | "gloo"
    group: ProcessGroup  # the default (WORLD) group
    #: A gloo group of the same ranks for host values (None: ``group``, when it is gloo).
    cpu_group: ProcessGroup | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes the shared outputs and emits the run's events."""
        return self.rank == 0


def _int_env(name: str, env: dict[str, str], *, low: int, high: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        raise ValueError(f"{name} is not set (a distributed run needs {', '.join(_REQUIRED)})")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name}={value} must be {bound}")
    return value


def _uses_cuda(device: str) -> bool:
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but CUDA is not available")
        return True
    return device == "auto" and torch.cuda.is_available()


def _cuda_index(local_rank: int) -> int:
    """The rank's GPU: its own when more than one is visible (all the node's GPUs), else the only one."""
    import torch

    n = torch.cuda.device_count()
    if n > 1:
        if local_rank >= n:
            raise ValueError(f"LOCAL_RANK={local_rank} but only {n} GPUs are visible")
        return local_rank
    return 0


def init_from_env(*, device: str = "auto", timeout_seconds: float = 1800) -> DistContext | None:
    """Join the job's process group described by the environment; None for a single-process run
    (WORLD_SIZE unset or 1). Raises ValueError for missing or inconsistent variables."""
    env = dict(os.environ)
    ws_raw = env.get("WORLD_SIZE", "").strip()
    if ws_raw in ("", "1"):
        return None
    world_size = _int_env("WORLD_SIZE", env, low=1)
    rank = _int_env("RANK", env, low=0, high=world_size - 1)
    local_rank = _int_env("LOCAL_RANK", env, low=0) if env.get("LOCAL_RANK", "").strip() else rank
    if not env.get("MASTER_ADDR", "").strip():
        raise ValueError("MASTER_ADDR is not set (a distributed run needs the address of rank 0)")
    _int_env("MASTER_PORT", env, low=1, high=65535)
    if timeout_seconds <= 0:
        raise ValueError(f"timeout_seconds must be positive, not {timeout_seconds}")

    import torch
    import torch.distributed as tdist

    cuda = _uses_cuda(device)
    backend = "nccl" if cuda else "gloo"
    kwargs: dict[str, Any] = {}
    if cuda:
        dev = torch.device("cuda", _cuda_index(local_rank))
        torch.cuda.set_device(dev)
        kwargs["device_id"] = dev  # binds the NCCL communicator to this rank's GPU (eager init)
    if not tdist.is_initialized():
        tdist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_seconds),
            **kwargs,
        )
    group = tdist.group.WORLD
    assert group is not None
    cpu_group = tdist.new_group(backend="gloo") if backend != "gloo" else None  # collective: every rank
    return DistContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        backend=backend,
        group=group,
        cpu_group=cpu_group,
    )


def rank_device(ctx: DistContext | None, pref: str) -> torch.device:
    """The device this rank trains on, for a spec's ``device`` preference (auto|cuda|cpu)."""
    import torch

    if pref == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but CUDA is not available")
    if ctx is not None:
        if ctx.backend == "nccl":
            if pref == "cpu":
                raise ValueError("a NCCL group trains on CUDA; device 'cpu' needs a gloo group")
            return torch.device("cuda", torch.cuda.current_device())  # set by init_from_env
        if pref == "cuda":
            raise ValueError("device 'cuda' with a gloo group: start the ranks with device 'cuda' or 'auto'")
        return torch.device("cpu")
    if pref == "cuda" or (pref == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shutdown(ctx: DistContext | None) -> None:
    """Leave the process group (idempotent; never raises: it runs on error paths too)."""
    if ctx is None:
        return
    with contextlib.suppress(Exception):
        import torch.distributed as tdist

        if tdist.is_initialized():
            tdist.destroy_process_group()


def _tensor_device(ctx: DistContext) -> torch.device:
    import torch

    if ctx.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_object(ctx: DistContext, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (picklable objects)."""
    import torch.distributed as tdist

    box = [obj if ctx.rank == 0 else None]
    tdist.broadcast_object_list(box, src=0, group=ctx.group, device=_tensor_device(ctx))
    return box[0]


def all_gather_object(ctx: DistContext, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    import torch.distributed as tdist

    out: list[Any] = [None] * ctx.world_size
    tdist.all_gather_object(out, obj, group=ctx.group)
    return out


def all_sum(ctx: DistContext | None, values: Sequence[float]) -> list[float]:
    """Element-wise sums across ranks, in float64 (the values themselves without a group).

    One all-reduce, over the host group when there is one (no device work, no device sync)."""
    if ctx is None:
        return [float(v) for v in values]
    import torch
    import torch.distributed as tdist

    host = ctx.cpu_group is not None or ctx.backend == "gloo"
    group = ctx.cpu_group if ctx.cpu_group is not None else ctx.group
    device = torch.device("cpu") if host else _tensor_device(ctx)
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    tdist.all_reduce(t, op=tdist.ReduceOp.SUM, group=group)
    return [float(v) for v in t.cpu().tolist()]


def any_rank(ctx: DistContext | None, flag: bool) -> bool:
    """True when ``flag`` is true on any rank (``flag`` itself without a group)."""
    if ctx is None:
        return bool(flag)
    return all_sum(ctx, [1.0 if flag else 0.0])[0] > 0


def barrier(ctx: DistContext | None) -> None:
    """Wait until every rank gets here (nothing without a group)."""
    if ctx is None:
        return
    import torch.distributed as tdist

    if ctx.backend == "nccl":
        tdist.barrier(group=ctx.group, device_ids=[_tensor_device(ctx).index or 0])
    else:
        tdist.barrier(group=ctx.group)

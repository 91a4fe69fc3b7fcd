"""The engine in a torch.distributed process group: who owns which shard, and the collectives it uses.

Data parallel, ZeRO-2 style. Every rank holds an identical replica of the model. In ``engine.step()``
the gradients are averaged across ranks (:func:`average_gradients`: all-reduce in flat buckets; the
``offload`` mode reduce-scatters instead, see :mod:`offload.offload_mode`), so everything computed from
them (the clipping norm, the non-finite verdict, zenflow's column selection and its device update) is
the same on every rank. The CPU optimizer state of a host store is cut into ``world`` contiguous
shards of its flat layout (:func:`shard_range`); a rank updates its own shard only and the updated
values are all-gathered (:class:`ShardGather`) into every replica.

Two groups (gloo). The training thread's collectives run on the caller's group; the CPU optimizer
thread's all-gathers run on a second group over the same ranks (:class:`EngineGroup.side`), created
collectively with the engine, so the two threads never interleave operations on one group. With NCCL
every collective stays on the training thread (the CPU thread only uploads its shard), since NCCL kernels
of two communicators launched in different orders on different ranks can deadlock: there the pending
all-gather is completed by the next collect, or earlier by ``state_dict()`` / ``consolidated()``
(collective then). ``OFFLOAD_TRAINING_THREAD_GATHERS=1`` (read when the engine is built) makes a gloo
group take that path too, so CPU tests cover it.

Collectives on gloo take CPU tensors, on NCCL CUDA tensors on the rank's device; the engine's device
tensors are on that device in both cases. Reductions are summed and then divided by ``world``
(``ReduceOp.AVG`` exists on NCCL only).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# torch 2.13 names the flat collectives ``reduce_scatter_single`` / ``all_gather_single`` and deprecates
# the older ``reduce_scatter_tensor`` / ``all_gather_into_tensor``, the only names up to 2.12 (the lent
# GPU machines run 2.11): the new name where it exists, else the old one (the same operation).
_reduce_scatter_flat_op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat_op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: Elements per all-reduce bucket (per dtype): large enough to amortise the launch, small enough that
#: the flat copy stays a modest transient on the device.
BUCKET_ELEMENTS = 32 * 1024 * 1024

#: Environment switch (tests): a gloo group gathers on the training thread, as with NCCL.
TRAINING_THREAD_GATHERS_ENV = "OFFLOAD_TRAINING_THREAD_GATHERS"


@dataclass(frozen=True)
class EngineGroup:
    """The process group the engine runs in (``world == 1``: a single process, no group)."""

    group: Any = None
    side: Any = None
    world: int = 1
    rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def training_thread_gathers(self) -> bool:
        """No side group (NCCL, or the test switch): every collective, the CPU result's all-gather
        included, runs on the training thread."""
        return self.distributed and self.side is None

    @classmethod
    def of(cls, group: Any) -> EngineGroup:
        """EngineGroup of ``group`` (``None``: a single process). Collective: every rank of the group must
        construct its engine, since the CPU thread's side group is created here."""
        if group is None:
            return cls()
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("process_group given but torch.distributed is not initialized")
        world = dist.get_world_size(group)
        if world == 1:
            return cls(group=group)
        ranks = dist.get_process_group_ranks(group)
        backend = dist.get_backend(group)
        # gloo only: with NCCL every collective stays on the training thread (offload.zenflow.mode)
        side_group = backend == "gloo" and os.environ.get(TRAINING_THREAD_GATHERS_ENV) != "1"
        side = dist.new_group(ranks=ranks, backend=backend) if side_group else None
        return cls(group=group, side=side, world=world, rank=dist.get_rank(group))


def wire_bytes(kind: str, nbytes: int, world: int) -> int:
    """Bytes one rank sends for a collective over a buffer of ``nbytes`` (the whole buffer: for a
    reduce-scatter its input, for an all-gather its output) with ring algorithms: an all-reduce
    ``2 (N-1)/N``, a reduce-scatter or an all-gather ``(N-1)/N`` of it. What ``StepMetrics.bytes_reduced``
    and ``bytes_gathered`` count."""
    share = nbytes * (world - 1) // world
    return 2 * share if kind == "all_reduce" else share


@dataclass
class Reduced:
    """A step's gradient after the reduction across ranks, as the clipping sees it."""

    #: Tensors holding the mean gradient, the same on every rank.
    replicated: list[torch.Tensor]
    #: This rank's disjoint shards of the rest of the mean gradient (the norm sums over ranks).
    shards: list[torch.Tensor] = field(default_factory=list)
    #: Other tensors to scale by the clipping coefficient (where reduced values were written back).
    also: list[torch.Tensor] = field(default_factory=list)
    #: Optional, for a norm computed like a single process's (a norm per parameter, then the norm of
    #: those, in parameter order): ``(position, tensor, sharded)`` per replicated gradient or shard
    #: piece of a parameter, and the number of parameters with a gradient.
    norm_parts: list[tuple[int, torch.Tensor, bool]] = field(default_factory=list)
    num_params: int = 0


def shard_range(numel: int, world: int, rank: int) -> tuple[int, int, int]:
    """``(lo, hi, size)``: rank's contiguous shard ``[lo, hi)`` of ``numel`` elements cut in ``world``
    equal shards of ``size`` (the last ones shorter or empty; all-gathers pad to ``world * size``)."""
    size = max(1, math.ceil(numel / world))
    lo = min(numel, rank * size)
    return lo, min(numel, lo + size), size


#: Device copies of local gradient-presence patterns (few distinct ones per job), by device and pattern.
_PRESENCE: dict[tuple[torch.device, tuple[bool, ...]], torch.Tensor] = {}


def fill_missing_gradients(params: Sequence[torch.Tensor], ranks: EngineGroup) -> None:
    """Give a zero gradient to every parameter some other rank has a gradient for (a rank whose batch
    did not reach it). One small all-reduce of the presence flags (every rank takes part); only a rank
    that lacks some gradient reads the result back (a host sync): the usual rank, with every gradient,
    learns nothing from it and does not wait for it. The flags are uploaded once per pattern."""
    device = params[0].device
    local = tuple(p.grad is not None for p in params)
    key = (device, local)
    src = _PRESENCE.get(key)
    if src is None:
        if len(_PRESENCE) >= 64:
            _PRESENCE.clear()
        src = _PRESENCE[key] = torch.tensor(local, dtype=torch.uint8).to(device)
    have = src.clone()
    dist.all_reduce(have, op=dist.ReduceOp.MAX, group=ranks.group)
    if all(local):
        return
    for p, any_rank in zip(params, have.tolist(), strict=True):
        if any_rank and p.grad is None:
            p.grad = torch.zeros_like(p)


@torch.no_grad()
def average_gradients(
    grads: Sequence[torch.Tensor], ranks: EngineGroup, bucket: int = BUCKET_ELEMENTS
) -> int:
    """All-reduce ``grads`` in place to their mean across ranks, in flat buckets per dtype; the bytes
    this rank sent (:func:`wire_bytes`)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    sent = 0
    for group in by_dtype.values():
        start = 0
        while start < len(group):
            part: list[torch.Tensor] = []
            n = 0
            while start < len(group) and (not part or n + group[start].numel() <= bucket):
                part.append(group[start])
                n += group[start].numel()
                start += 1
            flat = torch.cat([g.reshape(-1) for g in part]) if len(part) > 1 else part[0].reshape(-1).clone()
            dist.all_reduce(flat, group=ranks.group)
            flat.div_(ranks.world)
            torch._foreach_copy_(
                part, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in part]), part, strict=True)]
            )
            sent += wire_bytes("all_reduce", flat.numel() * flat.element_size(), ranks.world)
    return sent


def global_norm(local_sq: torch.Tensor, ranks: EngineGroup) -> torch.Tensor:
    """L2 norm over all ranks from each rank's summed squares of its disjoint part (in place)."""
    dist.all_reduce(local_sq, group=ranks.group)
    return local_sq.sqrt()


def reduce_scatter_mean(out: torch.Tensor, flat: torch.Tensor, ranks: EngineGroup) -> None:
    """``out`` (``size`` elements) := this rank's shard of the mean of ``flat`` (``world * size``)."""
    _reduce_scatter_flat_op(out, flat, group=ranks.group)
    out.div_(ranks.world)


@torch.no_grad()
def reduce_scatter_flat(
    grads: Sequence[torch.Tensor | None],
    offsets: Sequence[int],
    out: torch.Tensor,
    ranks: EngineGroup,
    buf: FlatBuffer | None = None,
) -> int:
    """``out`` := this rank's shard of the mean of gradients laid out flat (gradient ``i`` at
    ``offsets[i]``, zeros where None; padded to ``world * out.numel()``: a host store's layout); the
    bytes this rank sent. ``buf``: a persistent flat input reused every step (else a transient one)."""
    if buf is None:
        flat = torch.zeros(ranks.world * out.numel(), dtype=out.dtype, device=out.device)
    else:
        flat = buf.flat
    for i, (g, off) in enumerate(zip(grads, offsets, strict=True)):
        if g is not None:
            flat.narrow(0, off, g.numel()).copy_(g.reshape(-1))
        elif buf is not None:  # last step's values may lie there
            flat.narrow(0, off, buf.numels[i]).zero_()
    reduce_scatter_mean(out, flat, ranks)
    return wire_bytes("reduce_scatter", flat.numel() * flat.element_size(), ranks.world)


class FlatBuffer:
    """The flat input of :func:`reduce_scatter_flat` kept across steps: the split gradients are copied
    into it instead of into a fresh gradient-sized allocation every step. The padding is zeroed once;
    ``numels`` (each gradient's length) lets a missing gradient's range be zeroed."""

    def __init__(
        self, numels: Sequence[int], size: int, world: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.numels = list(numels)
        self.flat = torch.zeros(world * size, dtype=dtype, device=device)

    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class ShardGather:
    """One host store's replica buffer: each rank's updated shard in, every rank's out.

    ``full`` (``world * size`` elements in the parameters' dtype, on the device) holds the gathered
    values; parameter ``i`` of the store is ``full[offset_i : offset_i + numel_i]`` (the store's global
    flat layout). ``mine`` is this rank's slot the shard is uploaded into before the all-gather.
    """

    def __init__(self, size: int, world: int, dtype: torch.dtype, device: torch.device) -> None:
        self.size = size
        self.full = torch.empty(world * size, dtype=dtype, device=device)
        self.mine = torch.zeros(size, dtype=dtype, device=device)

    def view(self, offset: int, shape: Sequence[int]) -> torch.Tensor:
        n = math.prod(shape)
        return self.full.narrow(0, offset, n).view(*shape)

    def gather(self, group: Any) -> int:
        """All-gather every rank's ``mine`` into ``full`` (on ``group``); the bytes sent (:func:`wire_bytes`)."""
        _all_gather_flat_op(self.full, self.mine, group=group)
        world = self.full.numel() // self.size
        return wire_bytes("all_gather", self.full.numel() * self.full.element_size(), world)

    def nbytes(self) -> int:
        return (self.full.numel() + self.mine.numel()) * self.full.element_size()

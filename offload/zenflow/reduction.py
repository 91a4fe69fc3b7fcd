"""zenflow's gradient reduction in a process group: reduce-scatter where only the CPU needs the values.

Of a split weight's mean gradient the device needs only its selected columns (and, at a reselection,
every column's score), while the host needs only this rank's shard (the window accumulator). So with
host accumulation, once a selection exists:

- the split weights' gradients are reduce-scattered per host store (``(N-1)/N`` of the gradient bytes
  on a ring, against ``2(N-1)/N`` for an all-reduce), giving this rank's shard of the mean;
- their selected columns (``topk_ratio`` of them) are all-reduced and written back into ``.grad``,
  where the device optimizer reads them (the rest of ``.grad`` keeps this rank's own values: nothing
  reads it);
- the device-owned parameters (1-D, fully selected) are all-reduced;
- column scores for a reselection are summed from each rank's shard (every element lies in exactly
  one shard) in one all-reduce of ``cols`` floats per weight.

The first selection (which needs the whole mean gradient once) and device accumulation (whose fp32
accumulator is a whole-gradient buffer on the device) all-reduce every gradient instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from offload.collectives import Reduced, average_gradients, reduce_scatter_flat, wire_bytes
from offload.timing import StepStats

if TYPE_CHECKING:
    from offload.zenflow.mode import ZenFlowMode


def uses_shards(mode: ZenFlowMode) -> bool:
    """Whether this step reduce-scatters (see the module docstring)."""
    return bool(mode.splits) and not mode.on_device and (mode.started or mode.warm_left > 0)


@torch.no_grad()
def reduce_zenflow(mode: ZenFlowMode, stats: StepStats) -> tuple[Reduced, list[torch.Tensor]]:
    """The step's reduction when :func:`uses_shards`, and this rank's gradient shard of every host store."""
    ranks = mode.ranks
    split_ids = {id(s.param) for s in mode.splits}
    full = [p.grad for _, p in mode.named if p.grad is not None and id(p) not in split_ids]
    if full:
        stats.bytes_reduced += average_gradients(full, ranks)
    shards = []
    for store in mode.stores:
        in_order = [s.param.grad for s in mode.splits if s.store is store]  # the store's parameter order
        out = torch.empty(store.shard_size, dtype=store.dtype, device=mode.ops.device)  # fresh: read later
        stats.bytes_reduced += reduce_scatter_flat(in_order, store.full_offsets, out, ranks)
        shards.append(out.narrow(0, 0, store.numel))
    also = []
    if mode.started:  # the device's columns: their mean, written back where the device optimizer reads it
        for store in mode.stores:
            members = [s for s in mode.splits if s.store is store and s.param.grad is not None]
            if not members:
                continue
            pairs = [(s.param.grad, mode.dev.columns(s.name)) for s in members]
            grads = [g for g, _ in pairs if g is not None]
            cols = [c for _, c in pairs if c is not None]
            assert len(grads) == len(cols) == len(members)  # members have a gradient; selection started
            picked = torch.cat([g.index_select(1, c).reshape(-1) for g, c in zip(grads, cols, strict=True)])
            dist.all_reduce(picked, group=ranks.group)
            picked.div_(ranks.world)
            stats.bytes_reduced += wire_bytes(
                "all_reduce", picked.numel() * picked.element_size(), ranks.world
            )
            off = 0
            for g, c in zip(grads, cols, strict=True):
                n = g.shape[0] * c.numel()
                g.index_copy_(1, c, picked.narrow(0, off, n).view(g.shape[0], c.numel()))
                off += n
                also.append(g)
    # the norm per parameter, as one process computes it (offload.clipping)
    order = {id(p): i for i, p in enumerate(p for _, p in mode.named if p.grad is not None)}
    parts: list[tuple[int, torch.Tensor, bool]] = [
        (order[id(g_owner)], g_owner.grad, False)
        for _, g_owner in mode.named
        if g_owner.grad is not None and id(g_owner) not in split_ids
    ]
    for s in mode.splits:
        if s.param.grad is not None:
            si = mode.stores.index(s.store)
            parts.append(
                (
                    order[id(s.param)],
                    shards[si].narrow(0, s.store.offsets[s.index], s.store.numels[s.index]),
                    True,
                )
            )
    return Reduced(full, shards, also, parts, len(order)), shards


@torch.no_grad()
def shard_scores(mode: ZenFlowMode, shards: list[torch.Tensor], stats: StepStats) -> dict[str, torch.Tensor]:
    """Every split weight's column scores (sum of |g| over its rows) of the mean gradient, from each
    rank's shard: partial sums over the rows a shard holds, added across ranks in one all-reduce."""
    parts: list[torch.Tensor] = []
    names: list[str] = []
    for s in mode.splits:
        if s.param.grad is None:
            continue
        store = s.store
        cols = s.param.shape[1]
        n, a = store.numels[s.index], store.param_starts[s.index]
        partial = torch.zeros(cols, dtype=torch.float32, device=mode.ops.device)
        if n:
            r0, r1 = a // cols, -(-(a + n) // cols)
            held = torch.zeros((r1 - r0) * cols, dtype=torch.float32, device=mode.ops.device)
            start = a - r0 * cols
            piece = shards[mode.stores.index(store)].narrow(0, store.offsets[s.index], n)
            held[start : start + n] = piece.abs()
            partial = held.view(r1 - r0, cols).sum(0)
        parts.append(partial)
        names.append(s.name)
    if not parts:
        return {}
    flat = torch.cat(parts)
    dist.all_reduce(flat, group=mode.ranks.group)
    stats.bytes_reduced += wire_bytes("all_reduce", flat.numel() * flat.element_size(), mode.ranks.world)
    return dict(zip(names, flat.split([p.numel() for p in parts]), strict=True))


def split_sq(mode: ZenFlowMode, shards: list[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norm of the split weights' whole mean gradient, from every rank's shard (one scalar
    all-reduce)."""
    sq = torch.stack(torch._foreach_norm(shards, 2, dtype=torch.float32)).square().sum()
    dist.all_reduce(sq, group=mode.ranks.group)
    return sq

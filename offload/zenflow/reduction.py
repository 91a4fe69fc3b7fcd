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

import torch
import torch.distributed as dist

from offload.collectives import (
    EngineGroup,
    FlatBuffer,
    Reduced,
    average_gradients,
    reduce_scatter_flat,
    wire_bytes,
)
from offload.device import DeviceOps
from offload.mode_base import NamedParams
from offload.timing import StepStats
from offload.zenflow.layout import Columns, HostLayout


class ShardReduction:
    """The reduction above for one engine; ``shards`` is this step's gradient shard of every host
    store (None when the step all-reduced every gradient instead)."""

    def __init__(
        self, named: NamedParams, layout: HostLayout, ops: DeviceOps, ranks: EngineGroup, *, on_device: bool
    ) -> None:
        self.named, self.layout, self.ops, self.ranks = named, layout, ops, ranks
        self.on_device = on_device
        self.shards: list[torch.Tensor] | None = None
        #: per store, the reduce-scatter's flat input, reused every step (made on first use)
        self.flat: list[FlatBuffer] = []

    @torch.no_grad()
    def reduce(self, stats: StepStats, columns: Columns | None, *, warming: bool) -> Reduced | None:
        """Reduce this step's gradients (``columns``: the current selection, None before the first;
        ``warming``: a warm-up round, which needs this rank's shard only). None: this step does not
        reduce-scatter (see the module docstring); the caller all-reduces every gradient."""
        lay = self.layout
        if not lay.splits or self.on_device or (columns is None and not warming):
            self.shards = None
            return None
        split_ids = {id(s.param) for s in lay.splits}
        full = [p.grad for _, p in self.named if p.grad is not None and id(p) not in split_ids]
        if full:
            stats.bytes_reduced += average_gradients(full, self.ranks)
        shards = self._scatter(stats)
        also = self._reduce_columns(stats, columns) if columns is not None else []
        parts, count = self._norm_parts(split_ids, shards)
        self.shards = shards
        return Reduced(full, shards, also, parts, count)

    def _scatter(self, stats: StepStats) -> list[torch.Tensor]:
        """Every host store's split gradients reduce-scattered: this rank's shard of their mean each."""
        lay, ranks = self.layout, self.ranks
        shards = []
        if not self.flat:
            self.flat = [
                FlatBuffer(st.full_numels, st.shard_size, ranks.world, st.dtype, self.ops.device)
                for st in lay.stores
            ]
        for store, buf in zip(lay.stores, self.flat, strict=True):
            in_order = [s.param.grad for s in lay.members(store)]  # the store's parameter order
            out = torch.empty(
                store.shard_size, dtype=store.dtype, device=self.ops.device
            )  # fresh: read later
            stats.bytes_reduced += reduce_scatter_flat(in_order, store.full_offsets, out, ranks, buf)
            shards.append(out.narrow(0, 0, store.numel))
        return shards

    def _reduce_columns(self, stats: StepStats, columns: Columns) -> list[torch.Tensor]:
        """The device's columns: their mean, written back where the device reads it; the gradients
        written."""
        lay, ranks = self.layout, self.ranks
        also = []
        for store in lay.stores:
            members = [s for s in lay.members(store) if s.param.grad is not None]
            if not members:
                continue
            pairs = [(s.param.grad, columns(s.name)) for s in members]
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
        return also

    def _norm_parts(
        self, split_ids: set[int], shards: list[torch.Tensor]
    ) -> tuple[list[tuple[int, torch.Tensor, bool]], int]:
        """The gradient norm's parts per parameter, as one process computes it (offload.clipping):
        ``(index, tensor, is a shard)``, and how many parameters have a gradient."""
        lay = self.layout
        order = {id(p): i for i, p in enumerate(p for _, p in self.named if p.grad is not None)}
        parts: list[tuple[int, torch.Tensor, bool]] = [
            (order[id(g_owner)], g_owner.grad, False)
            for _, g_owner in self.named
            if g_owner.grad is not None and id(g_owner) not in split_ids
        ]
        for s in lay.splits:
            if s.param.grad is not None:
                si = lay.stores.index(s.store)
                parts.append(
                    (
                        order[id(s.param)],
                        shards[si].narrow(0, s.store.offsets[s.index], s.store.numels[s.index]),
                        True,
                    )
                )
        return parts, len(order)

    @torch.no_grad()
    def scores(self, stats: StepStats) -> dict[str, torch.Tensor] | None:
        """Every split weight's column scores (sum of |g| over its rows) of the mean gradient, from each
        rank's shard: partial sums over the rows a shard holds, added across ranks in one all-reduce.
        None when this step did not reduce-scatter (the scores come from ``.grad`` then)."""
        if self.shards is None:
            return None
        lay, dev = self.layout, self.ops.device
        parts: list[torch.Tensor] = []
        names: list[str] = []
        for s in lay.splits:
            if s.param.grad is None:
                continue
            store = s.store
            cols = s.param.shape[1]
            n, a = store.numels[s.index], store.param_starts[s.index]
            partial = torch.zeros(cols, dtype=torch.float32, device=dev)
            if n:
                r0, r1 = a // cols, -(-(a + n) // cols)
                held = torch.zeros((r1 - r0) * cols, dtype=torch.float32, device=dev)
                start = a - r0 * cols
                piece = self.shards[lay.stores.index(store)].narrow(0, store.offsets[s.index], n)
                held[start : start + n] = piece.abs()
                partial = held.view(r1 - r0, cols).sum(0)
            parts.append(partial)
            names.append(s.name)
        if not parts:
            return {}
        flat = torch.cat(parts)
        dist.all_reduce(flat, group=self.ranks.group)
        stats.bytes_reduced += wire_bytes("all_reduce", flat.numel() * flat.element_size(), self.ranks.world)
        return dict(zip(names, flat.split([p.numel() for p in parts]), strict=True))

    def split_sq(self) -> torch.Tensor:
        """Squared L2 norm of the split weights' whole mean gradient, from every rank's shard (one scalar
        all-reduce); only when this step reduce-scattered."""
        assert self.shards is not None
        sq = torch.stack(torch._foreach_norm(self.shards, 2, dtype=torch.float32)).square().sum()
        dist.all_reduce(sq, group=self.ranks.group)
        return sq

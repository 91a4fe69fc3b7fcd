"""Columns changing hands between the device and the CPU master at a zenflow reselection.

Into the device (:meth:`Handover.values_from_master`): for bf16/fp16 weights a newly selected column
starts its fp32 device master from the CPU master's value (more precise than the device copy). One
blocking read of every group's new columns together (the reselection's one host sync; none for fp32
weights), a gather from the CPU masters into transient host memory, an asynchronous upload; in a
process group each element comes from the one rank whose shard holds it (an all-reduce of the
partly zero values).

Out of the device (the *stash*): a reselection's old columns, which of them were dropped and their
newest fp32 values stay on the device (:meth:`Handover.stash_out`) until the next boundary, after the
CPU result that was computed without them has been collected, writes the dropped ones into the CPU
master (:meth:`Handover.apply`: copied off the device then, into transient host memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.collectives import Ranks, wire_bytes
from offload.device import DeviceOps
from offload.timing import StepStats
from offload.zenflow.column_groups import Dropped
from offload.zenflow.layout import HostLayout
from offload.zenflow.selective_adamw import NewValues


@dataclass(slots=True)
class Stash:
    """A reselection's old columns of one group, kept on the device until the next boundary copies the
    dropped columns' values into the CPU master."""

    names: list[str]
    cols: torch.Tensor  # int64 [n, k]
    mask: torch.Tensor  # bool [n, k]: dropped
    values: torch.Tensor  # fp32 [n, rows, k]
    ready: torch.cuda.Event | None  # recorded once they were final (CUDA)


class Handover:
    """See the module docstring. ``stash_groups``: dropped columns still on the device; ``stash``:
    those of a loaded state, per weight name (cols, fp32 values)."""

    def __init__(self, layout: HostLayout, ops: DeviceOps, ranks: Ranks) -> None:
        self.layout, self.ops, self.ranks = layout, ops, ranks
        self.stash_groups: list[Stash] = []
        self.stash: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    # --- into the device --------------------------------------------------------------------------
    def values_from_master(self, stats: StepStats) -> NewValues | None:
        """For bf16/fp16 weights: the CPU master's fp32 values of newly selected columns, on the device
        (the device optimizer calls it with every group's new columns; None for fp32 weights)."""
        if not self.layout.low:
            return None
        by_name, ops, ranks = self.layout.by_name, self.ops, self.ranks

        def values(groups: list[tuple[list[str], torch.Tensor]]) -> list[torch.Tensor]:
            host = ops.to_host(torch.cat([c.reshape(-1) for _, c in groups]))
            out, off = [], 0
            for names, cols in groups:
                n, k = cols.shape
                rows = by_name[names[0]].param.shape[0]
                # transient, not page-locked: the upload returns once it has read the buffer
                vals = ops.host.scratch(n * rows * k, torch.float32).view(n, rows, k)
                for j, name in enumerate(names):
                    s = by_name[name]
                    cols = host[off + j * k : off + (j + 1) * k]
                    if s.store.sharded:  # the rows this rank's shard holds; the other ranks fill the rest
                        vals[j].zero_()
                        held, r0, _, _ = s.store.rows_view(s.store.master, s.index)
                        torch.index_select(held, 1, cols, out=vals[j][r0 : r0 + held.shape[0]])
                    else:
                        master = s.store.shaped(s.store.master, s.index)
                        torch.index_select(master, 1, cols, out=vals[j])
                off += n * k
                dev_vals, t = ops.upload(vals)
                stats.bytes_h2d += t.nbytes
                if ranks.distributed:  # each element comes from the one rank that holds it
                    torch.distributed.all_reduce(dev_vals, group=ranks.group)
                    stats.bytes_reduced += wire_bytes("all_reduce", t.nbytes, ranks.world)
                out.append(dev_vals)
            return out

        return values

    # --- out of the device ------------------------------------------------------------------------
    def stash_out(self, d: Dropped) -> None:
        """Keep a group's old columns, dropped mask and values on the device until the next boundary."""
        self.stash_groups.append(Stash(d.names, d.cols, d.mask, d.values, self.ops.record()))

    def apply(self, stats: StepStats) -> None:
        """CPU master of the stashed dropped columns := their last device values."""
        for st in self.stash_groups:
            cols, mask, values = self._to_host(st)
            stats.bytes_d2h += sum(t.numel() * t.element_size() for t in (cols, mask, values))
            for j, name in enumerate(st.names):
                keep = mask[j]
                self._write_master(name, cols[j][keep], values[j][:, keep])
        for name, (cols, vals) in self.stash.items():
            self._write_master(name, cols, vals)
        self.stash_groups, self.stash = [], {}

    def _write_master(self, name: str, cols: torch.Tensor, vals: torch.Tensor) -> None:
        s = self.layout.by_name[name]
        if not s.store.sharded:
            s.store.shaped(s.store.master, s.index).index_copy_(1, cols, vals)
            return
        if s.store.numels[s.index] == 0:
            return
        rows, r0, start, n = s.store.rows_view(s.store.master, s.index)  # the shard's rows only
        rows.index_copy_(1, cols, vals[r0 : r0 + rows.shape[0]])
        s.store.unrows(s.store.master, s.index, rows, start, n)

    def _to_host(self, st: Stash) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.ops.host
        out = (
            h.scratch(st.cols.numel(), torch.int64).view(st.cols.shape),
            h.scratch(st.mask.numel(), torch.bool).view(st.mask.shape),
            h.scratch(st.values.numel(), torch.float32).view(st.values.shape),
        )
        self.ops.d2h(list(zip(out, (st.cols, st.mask, st.values), strict=True)), ready=st.ready).wait()
        return out

    def stash_bytes(self) -> int:
        """Device bytes of the stashed values."""
        return sum(st.values.numel() * st.values.element_size() for st in self.stash_groups)

    # --- persistence ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The stash per weight name: (dropped cols, their fp32 values), on CPU."""
        out = {n: (c.clone(), v.clone()) for n, (c, v) in self.stash.items()}
        for st in self.stash_groups:
            cols, mask, values = self._to_host(st)
            for j, name in enumerate(st.names):
                keep = mask[j]
                out[name] = (cols[j][keep].clone(), values[j][:, keep].clone())
        return out

    def load_state_dict(self, sd: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.stash = {n: (torch.as_tensor(c), torch.as_tensor(v)) for n, (c, v) in sd.items()}
        self.stash_groups = []

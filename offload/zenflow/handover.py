"""Columns changing hands between the device and the CPU master at a zenflow reselection.

Into the device (:meth:`Handover.values_from_master`): for bf16/fp16 weights a newly selected column
starts its fp32 device master from the CPU master's value (more precise than the device copy). One
blocking read of every group's new columns together (the reselection's one host sync; none for fp32
weights), a gather from the CPU masters into transient page-locked memory, an asynchronous upload;
in a process group each element comes from the one rank whose shard holds it (an all-reduce of the
partly zero values).

Out of the device (the *stash*): a reselection's dropped columns stay on the device
(:meth:`Handover.stash_out`: every weight's old columns reordered dropped first, their fp32 values
stored column-major so each weight's dropped ones are one contiguous slab; how many per weight and
their indices leave for the host at once, a few bytes, asynchronously) until the next boundary, after
the CPU result that was computed without them has been collected, writes them into the CPU master
(:meth:`Handover.apply`). Only the dropped columns' values are copied (not the whole old selection),
into transient page-locked memory, on a stream of their own (not behind the CPU thread's gradient
chunks on the D2H stream), waited for by an event.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.collectives import EngineGroup, wire_bytes
from offload.device import DeviceOps
from offload.timing import StepStats
from offload.zenflow.column_groups import Dropped
from offload.zenflow.layout import HostLayout
from offload.zenflow.selective_adamw import NewValues


@dataclass(slots=True)
class Stash:
    """A reselection's dropped columns of one group, kept on the device until the next boundary copies
    their values into the CPU master."""

    names: list[str]
    values: torch.Tensor  # fp32 [n, k, rows]: entry j's old columns, its dropped ones first
    ready: torch.cuda.Event | None  # recorded once they were final (CUDA)
    #: host, int64 [n + n * k]: entry j's number of dropped columns, then every entry's old columns
    #: (dropped first); final once ``meta_ready`` has passed
    meta: torch.Tensor
    meta_ready: torch.cuda.Event | None


def _pinned(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A transient host buffer, page-locked on CUDA (torch's caching host allocator: reused, and kept
    until the asynchronous copies that use it have run)."""
    return torch.empty(numel, dtype=dtype, pin_memory=pin)


class Handover:
    """See the module docstring. ``stash_groups``: dropped columns still on the device; ``stash``:
    those of a loaded state, per weight name (cols, fp32 values)."""

    def __init__(self, layout: HostLayout, ops: DeviceOps, ranks: EngineGroup) -> None:
        self.layout, self.ops, self.ranks = layout, ops, ranks
        self.stash_groups: list[Stash] = []
        self.stash: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        #: CUDA: the stream the dropped columns leave the device on
        self.stream = torch.cuda.Stream(device=ops.device) if ops.is_cuda else None

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
                # transient, page-locked: the upload is asynchronous
                vals = _pinned(n * rows * k, torch.float32, ops.is_cuda).view(n, rows, k)
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
        """Keep a group's dropped columns on the device until the next boundary (see the module doc):
        no host sync, fixed shapes."""
        n, k = d.cols.shape
        rows = d.values.shape[1]
        order = torch.sort(torch.logical_not(d.mask).to(torch.uint8), dim=1, stable=True).indices
        cols = d.cols.gather(1, order)
        values = d.values.transpose(1, 2).gather(1, order.unsqueeze(2).expand(n, k, rows))
        small = torch.cat([d.mask.sum(1), cols.reshape(-1)])
        meta = _pinned(small.numel(), torch.int64, self.ops.is_cuda)
        meta.copy_(small, non_blocking=self.ops.is_cuda)
        ready = self.ops.record()
        self.stash_groups.append(Stash(list(d.names), values, ready, meta, ready))

    def _dropped(self, st: Stash, stats: StepStats | None) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(name, cols, values [rows, c])`` on the host of each entry's dropped columns: one copy of
        exactly their values, waited for."""
        if st.meta_ready is not None:
            st.meta_ready.synchronize()  # a few bytes queued a window ago: landed
        n, k, rows = st.values.shape
        counts = st.meta[:n].tolist()
        cols = st.meta[n:].view(n, k)
        host = _pinned(sum(counts) * rows, torch.float32, self.ops.is_cuda)
        pairs, off = [], 0
        for j, c in enumerate(counts):
            if c:
                pairs.append((host[off : off + c * rows], st.values[j, :c].reshape(-1)))
                off += c * rows
        if stats is not None:
            stats.bytes_d2h += host.numel() * host.element_size()
        self._copy_off(pairs, st.ready)
        out, off = [], 0
        for j, c in enumerate(counts):
            out.append((st.names[j], cols[j, :c], host[off : off + c * rows].view(c, rows).t()))
            off += c * rows
        return out

    def _copy_off(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], ready: torch.cuda.Event | None
    ) -> None:
        """Device ``src`` into host ``dst`` per pair, after ``ready``; returns once landed."""
        if not pairs:
            return
        dsts, srcs = [d for d, _ in pairs], [s for _, s in pairs]
        if self.stream is None:
            torch._foreach_copy_(dsts, srcs)
            return
        with torch.cuda.stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        for src in srcs:
            src.record_stream(self.stream)
        done.synchronize()

    def apply(self, stats: StepStats) -> None:
        """CPU master of the stashed dropped columns := their last device values."""
        for st in self.stash_groups:
            for name, cols, vals in self._dropped(st, stats):
                self._write_master(name, cols, vals)
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

    def stash_bytes(self) -> int:
        """Device bytes of the stashed values."""
        return sum(st.values.numel() * st.values.element_size() for st in self.stash_groups)

    # --- persistence ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The stash per weight name: (dropped cols, their fp32 values), on CPU."""
        out = {n: (c.clone(), v.clone()) for n, (c, v) in self.stash.items()}
        for st in self.stash_groups:
            for name, cols, vals in self._dropped(st, None):
                out[name] = (cols.clone(), vals.contiguous().clone())
        return out

    def load_state_dict(self, sd: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.stash = {n: (torch.as_tensor(c), torch.as_tensor(v)) for n, (c, v) in sd.items()}
        self.stash_groups = []

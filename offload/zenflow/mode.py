"""``zenflow`` mode: important columns on the device every step, the rest on the CPU in the background.

Parameters. A 2-D weight with ``k = ceil(topk_ratio * cols) < cols`` is *split*: its selected
columns (:mod:`offload.selection`) are updated on the device every step by
:class:`~offload.selective_adamw.SelectiveAdamW`; the whole weight also lives on the host (fp32
master, fp32 moments, :class:`~offload.host.HostStore`). Everything else (1-D params, and 2-D weights
whose every column is selected, e.g. ``topk_ratio=1``) is owned by the device optimizer outright.

Windows. Steps are grouped into windows ``v = 1, 2, ...`` of ``update_interval`` steps (or "auto",
below); the selection ``S_v`` is fixed within a window. Every step, after global clipping:

1. the device updates the selected columns (and the device-only params);
2. the worker adds the split params' whole gradients into the window's host accumulator
   (``bufs[v % 2]``, in the parameters' dtype: summed in fp32, rounded once per step; each step's
   gradient times ``1/update_interval``, so the accumulator holds the window *mean*; for "auto" the
   sum is divided by the window length at the boundary). On CUDA the worker streams them off the
   device through a two-slot page-locked ring of ``cpu_chunk_elements`` (D2H stream, after an event
   recorded once the step's gradients are final); on a CPU device it reads them in place. Up to two
   steps' gradients are in flight; the engine keeps them referenced until read, and
   ``zero_grad(set_to_none=False)`` waits for those reads.
   With ``accumulate_on="device"`` the gradients are instead added into an fp32 accumulator on the
   device, which is copied, rounded to the parameters' dtype, into ``bufs[0]`` (async, D2H stream)
   once, at the boundary.

At the boundary ending window ``v`` the training thread:

a. waits for ``R_{v-1}``, the CPU AdamW result of the previous window (the only possible stall),
   and merges it into the device weights except the columns in ``S_{v-1} | S_v`` (union), where the device
   value wins (the device updated them, or the CPU result for them is void). ``S_{v-1}`` is the
   selection window ``v - 1`` ran under, not the one chosen at its end: a column dropped there was
   the device's, and the CPU master only gets its value in (b), after ``R_{v-1}`` was computed;
b. writes into the CPU master the stashed device values of the columns dropped from the selection
   at the previous boundary (the device was authoritative for them; this must wait for ``R_{v-1}``);
c. reselects if due (``select_interval`` steps since the last selection; "auto": when the caller
   called ``new_epoch()``, or every ``select_interval_fallback`` steps if it never does), every
   split weight batched with fixed shapes on the device. Columns that stay keep their device
   moments; new columns start at zero moments, step 0, their fp32 device master taken from the CPU
   master (one blocking read of the new columns for all bf16/fp16 weights together: the only host
   sync of a reselection; none for fp32; gathered in transient host memory); the old columns' newest
   fp32 values and which of them were dropped stay on the device until (b) copies them to the host;
d. submits AdamW on the window's mean gradient to the worker: one CPU step per window, at the lr
   current at the boundary (default, gradient-accumulation semantics, as DeepSpeed's ZenFlow) or with
   ``scale_cpu_lr`` at the sum of the learning rates of the window's steps (the linear scaling rule;
   it converges worse, see ``EngineConfig.scale_cpu_lr``).
   The CPU step writes the new bf16/fp16 parameters over the accumulator it read (fp32: the master
   is the result). On CUDA the worker then prefetches the result into device landing buffers on the
   H2D stream, so (a) at the next boundary is a device-to-device copy. Host bytes per split element:
   12 + 2 accumulators (or 1 with device accumulation) in the parameters' dtype, see
   :mod:`offload.memory`.

So the unimportant weights are exactly one window stale: the update from window ``v``'s gradients
reaches the model at the end of window ``v + 1``. With ``overlap_step=False`` the boundary instead
waits for window ``v``'s CPU step and applies it at once (no staleness, the CPU step is stall). A column that becomes selected loses the CPU
update of the window it was selected in (the device takes over from its value at that boundary).

"auto" window length: a window ends when the summed squared norm of the unselected gradient over
the window reaches the mean squared norm of the selected gradient per step, i.e. when the update
waiting on the CPU weighs as much as one step of what the device applies; at most
``max_update_interval`` steps. The two norms leave the device in a non-blocking copy queued before
the optimizer's kernels and are read after those are queued (no host sync per step). Warm-up: the
first ``full_warm_up_rounds`` steps update the split params synchronously on the CPU (offload style)
and select nothing.

Skipped steps (:mod:`offload.guard`): the device part is gated on the device; the host learns the
verdict once the step's device work is queued and then neither accumulates the step's gradient nor
counts it (window length, its learning rates, steps since the selection, warm-up rounds). A skipped
first step leaves nothing selected, so the next step selects afresh.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, cast

import torch

from offload.collectives import Ranks, Reduced, ShardGather, wire_bytes
from offload.config import EngineConfig
from offload.cpu_thread import CPUThread, gil_released
from offload.device import DeviceOps, Landing, Transfer
from offload.guard import Gate, zero_if_bad_
from offload.host import HostStore
from offload.memory import EngineMemory
from offload.mode_base import Mode, NamedParams, add_parts, nbytes
from offload.offload_mode import group_by_dtype
from offload.selection import num_selected, union
from offload.selective_adamw import AdamWHyper, Dropped, SelectiveAdamW
from offload.timing import StepStats
from offload.zenflow.reduction import reduce_zenflow, shard_scores, split_sq, uses_shards


@dataclass(slots=True)
class _Split:
    name: str
    param: torch.nn.Parameter
    store: HostStore
    index: int  # position inside ``store``
    k: int
    landing: torch.Tensor | None  # device buffer the CPU result is prefetched into (CUDA)
    dacc: torch.Tensor | None  # fp32 device accumulator (accumulate_on="device")


@dataclass(slots=True)
class _Staged:
    """This step's gradients, for the worker to add into the window's accumulator (host accumulation):
    per store its params' gradients (None: no gradient), final once ``ready`` has passed (CUDA)."""

    slot: int
    grads: list[tuple[int, list[torch.Tensor | None]]]  # (store index, gradients)
    ready: torch.cuda.Event | None
    #: process group: the gradients are already this rank's shard pieces (offload.zenflow.reduction)
    pieces: bool = False


@dataclass(slots=True)
class _Stash:
    """A reselection's old columns of one group, kept on the device until the next boundary copies the
    dropped columns' values into the CPU master."""

    names: list[str]
    cols: torch.Tensor  # int64 [n, k]
    mask: torch.Tensor  # bool [n, k]: dropped
    values: torch.Tensor  # fp32 [n, rows, k]
    ready: torch.cuda.Event | None  # recorded once they were final (CUDA)


@dataclass(slots=True)
class _Pending:
    #: resolves to (CPU seconds, bytes all-gathered into this rank's replica)
    future: Future[Any]
    #: The selection of the window this result was computed for (its columns are void in the result).
    sel: dict[str, torch.Tensor]
    h2d_bytes: int
    #: The host buffer the CPU step read its gradient from and wrote its bf16/fp16 result into.
    acc_index: int


class ZenFlowMode(Mode):
    name = "zenflow"

    def __init__(
        self,
        named: NamedParams,
        cfg: EngineConfig,
        ops: DeviceOps,
        ranks: Ranks | None = None,
        *,
        threads: int,
        worker_cores: list[int] | None,
    ) -> None:
        super().__init__(named, cfg, ops, ranks)
        self.threads = threads
        self.hyper = AdamWHyper(cfg.lr, cfg.betas[0], cfg.betas[1], cfg.eps, cfg.weight_decay)
        split_named: NamedParams = []
        self.full_names: list[str] = []
        for n, p in named:
            if p.dim() == 2 and num_selected(p.shape[1], cfg.topk_ratio) < p.shape[1]:
                split_named.append((n, p))
            else:
                self.full_names.append(n)
        self.on_device = cfg.accumulate_on == "device"
        self.splits: list[_Split] = []
        self.stores: list[HostStore] = []
        #: per store, host accumulation on CUDA: the two page-locked slots gradients stream through
        self.rings: list[list[torch.Tensor] | None] = []
        #: per store in a process group: the replica buffer every rank's updated shard is gathered into
        self.gathers: list[ShardGather] = []
        r = self.ranks
        for group in group_by_dtype(split_named):
            # host accumulation fills window v+1's accumulator while the worker reads window v's
            accs = 1 if self.on_device else 2
            store = HostStore(
                [p for _, p in group],
                ops.host,
                buffers=accs,
                role="accumulators",
                shard=(r.rank, r.world) if r.distributed else None,
            )
            self.stores.append(store)
            ring = None
            if not self.on_device and ops.is_cuda:
                size = max(1, min(store.numel, cfg.cpu_chunk_elements))
                ring = [ops.host.empty(size, store.dtype) for _ in range(2)]
            self.rings.append(ring)
            gather = (
                ShardGather(store.shard_size, r.world, store.dtype, ops.device) if r.distributed else None
            )
            if gather is not None:
                self.gathers.append(gather)
            for i, (n, p) in enumerate(group):
                like = p.detach()
                if gather is not None:  # the landing buffers are views of the gathered replica
                    landing: torch.Tensor | None = gather.view(store.full_offsets[i], like.shape)
                else:
                    landing = torch.empty_like(like) if ops.is_cuda else None
                dacc = (
                    torch.zeros(like.shape, dtype=torch.float32, device=like.device)
                    if self.on_device
                    else None
                )
                k = num_selected(p.shape[1], cfg.topk_ratio)
                self.splits.append(_Split(n, p, store, i, k, landing, dacc))
        self.by_name = {s.name: s for s in self.splits}
        self.dev = self._new_device_optimizer()
        self.worker: CPUThread | None = None
        if self.splits:
            self.worker = CPUThread(
                torch_threads=threads, cores=worker_cores, cuda_device=ops.device if ops.is_cuda else None
            )
        # Schedule state.
        self.warm_left = cfg.full_warm_up_rounds
        self.started = False
        self.window = 0  # index of the current window (parity picks its accumulator)
        self.win_len = 0  # steps accumulated in the current window
        self.win_lr = 0.0  # sum of the learning rates of those steps (scale_cpu_lr)
        self.since_select = 0
        self.reselections = 0  # reselections after the first selection (not persisted)
        self.win_sel = 0.0  # "auto": summed selected / unselected squared norms in the window
        self.win_unsel = 0.0
        self.epoch_seen = False  # the caller has called new_epoch() at least once
        self.epoch_flag = False  # ... and not since the last selection
        self.pending: _Pending | None = None
        # columns dropped at the previous reselection: batched host copies, and (from a loaded
        # state) per name (cols, fp32 values)
        self.stash_groups: list[_Stash] = []
        self.stash: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.low = any(s.param.dtype != torch.float32 for s in self.splits)
        self.slot = 0
        self.slot_futs: list[Future[Any] | None] = [None, None]
        self.merge_done: torch.cuda.Event | None = None
        self.dacc_free: torch.cuda.Event | None = None  # the last device-accumulator copy has been read
        #: process group: this step's reduce-scattered gradient shard per store (None: all-reduced)
        self.step_shards: list[torch.Tensor] | None = None

    def reduce(self, stats: StepStats) -> Reduced:
        if not uses_shards(self):  # every gradient all-reduced (offload.zenflow.reduction says when)
            self.step_shards = None
            return super().reduce(stats)
        reduced, self.step_shards = reduce_zenflow(self, stats)
        return reduced

    def _scores(self, stats: StepStats) -> dict[str, torch.Tensor] | None:
        """Column scores of the mean gradient when this step reduce-scattered it (else from ``.grad``)."""
        return shard_scores(self, self.step_shards, stats) if self.step_shards is not None else None

    def _acc_index(self) -> int:
        """Host accumulator of the current window (alternating with host accumulation)."""
        return self.window % (1 if self.on_device else 2)

    def _new_device_optimizer(self) -> SelectiveAdamW:
        dev = SelectiveAdamW(self.hyper)
        params = dict(self.named)
        for n in self.full_names:
            dev.add_full(n, params[n])
        return dev

    # --- per step -------------------------------------------------------------------------------
    def check(self) -> None:
        if self.worker is not None:
            self.worker.check()

    def new_epoch(self) -> None:
        self.epoch_seen = True
        self.epoch_flag = True

    @torch.no_grad()
    def step(self, stats: StepStats, lr: float, gate: Gate) -> None:
        self.check()
        if self.warm_left > 0:
            self.dev.step(lr, gate)
            stats.synchronous = True
            if gate.finite():  # a synchronous step: the host waits for its verdict anyway
                self._synchronous_update(stats, lr)
                self.warm_left -= 1
            return
        if not self.splits:
            self.dev.step(lr, gate)
            return
        starting = not self.started
        if starting:
            self._start(stats)
        auto = self.cfg.update_interval == "auto"
        # 1. queue the device work (gated on the device: nothing here waits for the verdict)
        staged = None
        if not self.on_device:
            # Both only read the (clipped) gradients: the copy off the device starts before the
            # device optimizer's kernels, not after them.
            staged = self._stage(stats)
        sq = self.dev.prepare(gate, want_sq=auto)
        masses = self._masses(sq) if sq is not None else None
        self.dev.update(lr)
        if self.on_device:
            self._accumulate_on_device(gate)
        # 2. host bookkeeping, from the verdict (landed by now: no wait)
        ok = gate.finite()
        if staged is not None:
            self._queue_accumulation(staged, ok)
        if not ok:
            if starting:  # nothing was updated: select afresh from the next step's gradient
                self.dev.reset_columns()
                self.started = False
            return
        self.win_len += 1
        self.win_lr += lr
        self.since_select += 1
        if masses is not None:
            ends = self._auto_window_ends(masses)
        else:
            ends = self.win_len >= int(self.cfg.update_interval)
        if ends:
            self._boundary(stats, lr, sync=not self.cfg.overlap_step, reselect=True)

    def _masses(self, sq: tuple[torch.Tensor, torch.Tensor]) -> Landing:
        """Start copying this step's selected and unselected gradient masses to the host ("auto")."""
        full_sq, cols_sq = sq  # the device's gradient parts: whole tensors, selected columns
        grads = [g for g in (s.param.grad for s in self.splits) if g is not None]
        if self.step_shards is not None:  # .grad holds the mean in the selected columns only
            total_split = split_sq(self, self.step_shards)
        elif grads:
            total_split = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()
        else:
            total_split = torch.zeros((), device=cols_sq.device)
        return self.ops.read_later([full_sq + cols_sq, (total_split - cols_sq).clamp(min=0)])

    def _auto_window_ends(self, masses: Landing) -> bool:
        sel_v, unsel_v = masses.values()
        self.win_sel += sel_v
        self.win_unsel += unsel_v
        mean_sel = self.win_sel / self.win_len
        return self.win_unsel >= mean_sel or self.win_len >= self.cfg.max_update_interval

    def _start(self, stats: StepStats) -> None:
        """First zenflow step: choose the initial selection from the current gradient."""
        for s in self.splits:  # placeholders, replaced at once by the batched selection below
            self.dev.add_columns(s.name, s.param, torch.arange(s.k, device=s.param.device))
        self.dev.reselect(self._values_from_master(stats), fresh=True, given_scores=self._scores(stats))
        self.started = True
        self.since_select = 0
        self.epoch_flag = False

    def _values_from_master(
        self, stats: StepStats
    ) -> Callable[[list[tuple[list[str], torch.Tensor]]], list[torch.Tensor]] | None:
        """For bf16/fp16 weights: the CPU master's fp32 values of newly selected columns, on the device.

        One blocking read of every group's new columns together (the reselection's one host sync),
        a gather from the CPU masters into page-locked buffers, and an asynchronous upload.
        """
        if not self.low:
            return None

        def values(groups: list[tuple[list[str], torch.Tensor]]) -> list[torch.Tensor]:
            host = self.ops.to_host(torch.cat([c.reshape(-1) for _, c in groups]))
            out, off = [], 0
            for names, cols in groups:
                n, k = cols.shape
                rows = self.by_name[names[0]].param.shape[0]
                # transient, not page-locked: the upload returns once it has read the buffer
                vals = self.ops.host.scratch(n * rows * k, torch.float32).view(n, rows, k)
                for j, name in enumerate(names):
                    s = self.by_name[name]
                    cols = host[off + j * k : off + (j + 1) * k]
                    if s.store.sharded:  # the rows this rank's shard holds; the other ranks fill the rest
                        vals[j].zero_()
                        held, r0, _, _ = s.store.rows_view(s.store.master, s.index)
                        torch.index_select(held, 1, cols, out=vals[j][r0 : r0 + held.shape[0]])
                    else:
                        master = s.store.shaped(s.store.master, s.index)
                        torch.index_select(master, 1, cols, out=vals[j])
                off += n * k
                dev_vals, t = self.ops.upload(vals)
                stats.bytes_h2d += t.nbytes
                if self.ranks.distributed:  # each element comes from the one rank that holds it
                    torch.distributed.all_reduce(dev_vals, group=self.ranks.group)
                    stats.bytes_reduced += wire_bytes("all_reduce", t.nbytes, self.ranks.world)
                out.append(dev_vals)
            return out

        return values

    def _stage(self, stats: StepStats) -> _Staged:
        """Take this step's split gradients for the worker (read after ``ready``); at most two steps'
        gradients are in flight, so this first waits for the accumulation of the step before last."""
        assert self.worker is not None
        slot = self.slot
        prev = self.slot_futs[slot]
        if prev is not None:
            with stats.blocked():
                self.worker.wait(prev)
            self.slot_futs[slot] = None
        grads: list[tuple[int, list[torch.Tensor | None]]] = []
        if self.step_shards is not None:  # this rank's shard of the mean: the part the host needs
            for si, (store, shard) in enumerate(zip(self.stores, self.step_shards, strict=True)):
                grads.append(
                    (si, [shard.narrow(0, o, n) for o, n in zip(store.offsets, store.numels, strict=True)])
                )
                stats.bytes_d2h += shard.numel() * shard.element_size()
            self.slot ^= 1
            return _Staged(slot, grads, self.ops.record(), pieces=True)
        for si, store in enumerate(self.stores):
            gs: list[torch.Tensor | None] = [None] * len(store.numels)
            for s in self.splits:
                if s.store is store and s.param.grad is not None:
                    g = s.param.grad
                    gs[s.index] = g
                    stats.bytes_d2h += g.numel() * g.element_size()
            grads.append((si, gs))
        self.slot ^= 1
        return _Staged(slot, grads, self.ops.record())

    def _queue_accumulation(self, staged: _Staged, ok: bool) -> None:
        """Have the worker add the staged gradient into the window's accumulator (not if skipped)."""
        assert self.worker is not None
        if not ok:
            return
        ui = self.cfg.update_interval
        alpha = 1.0 / ui if isinstance(ui, int) else 1.0
        grads, ready, pieces = staged.grads, staged.ready, staged.pieces

        def accumulate(first: bool = self.win_len == 0, acc_i: int = self._acc_index()) -> None:
            try:
                for si, gs in grads:
                    store, ring = self.stores[si], self.rings[si]
                    if ring is None:
                        self._accumulate_in_place(store, gs, acc_i, alpha, first, pieces)
                    else:
                        self._accumulate_through(store, gs, ring, ready, acc_i, alpha, first, pieces)
            finally:
                grads.clear()  # release the gradients now, not when the worker's next task replaces this one

        self.slot_futs[staged.slot] = self.worker.submit(accumulate, urgent=True)

    def _accumulate_in_place(
        self,
        store: HostStore,
        grads: list[torch.Tensor | None],
        acc_i: int,
        alpha: float,
        first: bool,
        pieces: bool = False,
    ) -> None:
        """The device is the CPU: add each gradient into the accumulator where it lies (``pieces``: the
        gradients are already this shard's pieces)."""
        acc = store.bufs[acc_i]
        for i, g in enumerate(grads):
            dst = store.flat(acc, i)
            if dst.numel() == 0:  # not in this rank's shard
                continue
            if g is not None:
                src = g if pieces else store.piece(g, i)
                store.accumulate(dst, src, alpha=alpha, first=first, num_threads=self.threads)
            elif first:
                dst.zero_()

    def _accumulate_through(
        self,
        store: HostStore,
        grads: list[torch.Tensor | None],
        ring: list[torch.Tensor],
        ready: torch.cuda.Event | None,
        acc_i: int,
        alpha: float,
        first: bool,
        as_pieces: bool = False,
    ) -> None:
        """CUDA: stream the gradients off the device in slot-sized chunks of the store's flat layout,
        copying chunk ``c + 1`` into one slot while chunk ``c`` is added from the other."""
        acc, size = store.bufs[acc_i], ring[0].numel()
        chunks = [(lo, min(store.numel, lo + size)) for lo in range(0, store.numel, size)]

        def pieces(lo: int, hi: int) -> list[tuple[int, int, int]]:
            """(param, start, end) in the param's flat index of the chunk's parts."""
            out = []
            for i, (off, n) in enumerate(zip(store.offsets, store.numels, strict=True)):
                a, b = max(lo, off), min(hi, off + n)
                if a < b:
                    out.append((i, a - off, b - off))
            return out

        def issue(c: int) -> Transfer:
            lo, hi = chunks[c]
            slot = ring[c % 2]
            pairs = []
            for i, a, b in pieces(lo, hi):
                g = grads[i]
                if g is not None:
                    base = store.offsets[i] + a - lo
                    pairs.append((slot[base : base + b - a], (g if as_pieces else store.piece(g, i))[a:b]))
            return self.ops.d2h(pairs, ready=ready)

        pending = issue(0)
        for c, (lo, hi) in enumerate(chunks):
            nxt = issue(c + 1) if c + 1 < len(chunks) else None
            with gil_released():
                pending.wait()
            slot = ring[c % 2]
            for i, a, b in pieces(lo, hi):
                if grads[i] is None:  # nothing was copied there
                    base = store.offsets[i] + a - lo
                    slot[base : base + b - a].zero_()
            store.accumulate(acc[lo:hi], slot[: hi - lo], alpha=alpha, first=first, num_threads=self.threads)
            for i, _, _ in pieces(lo, hi):  # a gradient wholly copied: let the device reuse its memory now,
                if store.offsets[i] + store.numels[i] <= hi:  # not at the end of the task (the next
                    grads[i] = None  # backward allocates its own while this one may still be held)
            if nxt is not None:
                pending = nxt

    def before_zero_grad(self) -> None:
        """The gradients are about to be zeroed in place: let the worker finish reading them."""
        if self.worker is None:
            return
        for i, fut in enumerate(self.slot_futs):
            if fut is not None:
                self.worker.wait(fut)
                self.slot_futs[i] = None

    def _accumulate_on_device(self, gate: Gate) -> None:
        ui = self.cfg.update_interval
        alpha = 1.0 / ui if isinstance(ui, int) else 1.0
        first = self.win_len == 0  # a skipped first step writes zeros, then the next one is first again
        if first:
            self.ops.compute_wait(self.dacc_free)  # the previous window's copy has left the accumulator
        accs: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for s in self.splits:
            assert s.dacc is not None
            g = s.param.grad
            if g is not None:
                accs.append(s.dacc)
                grads.append(g)
            elif first:
                s.dacc.zero_()
        if not accs:
            return
        zero_if_bad_(grads, gate)  # a skipped step adds exact zeros
        if first:
            torch._foreach_copy_(
                accs, grads
            )  # then scale in fp32 (a multiply would round in the grad's dtype)
            if alpha != 1.0:
                torch._foreach_mul_(accs, alpha)
        else:
            torch._foreach_add_(accs, grads, alpha=alpha)

    # --- window boundary ------------------------------------------------------------------------
    def _boundary(self, stats: StepStats, lr: float, *, sync: bool, reselect: bool) -> None:
        if self.pending is not None:
            self._collect(stats)
        # The selection this window ran under: its columns are void in the CPU result (the device
        # updated them, so the CPU master's values for them are stale). Taken before reselection, which
        # may drop some of them: a dropped column's device value must win at the next merge too (its
        # CPU master only gets that value from the stash after the result is computed).
        window_sel = self._current_selection()
        with stats.blocked():
            self._apply_stash(stats)
            if reselect and self._reselect_due():
                self._reselect(stats)
        self._submit_window(lr, stats, window_sel)
        if sync:  # no staleness: this window's result goes in now (the training thread waits for it)
            self._collect(stats)
            with stats.blocked():
                self._apply_stash(stats)
        self.window += 1
        self.win_len = 0
        self.win_lr = 0.0
        self.win_sel = self.win_unsel = 0.0

    def _collect(self, stats: StepStats) -> None:
        """Wait for the pending CPU result and merge it into the device weights."""
        assert self.worker is not None and self.pending is not None
        pending = self.pending
        with stats.blocked():
            seconds, gathered = self.worker.wait(pending.future)
            if self.gathers and self.ops.is_cuda:
                # NCCL: on the training thread, in step order. Two threads issuing collectives on two
                # communicators could launch them in different orders on different ranks, and NCCL
                # kernels waiting on each other deadlock; a device all-gather is fast anyway.
                gathered += sum(self._all_gather(si, self.ranks.group) for si in range(len(self.stores)))
            for s in self.splits:
                cur = self.dev.columns(s.name)
                assert cur is not None
                # The device keeps S_{v-1} | S_v. Saving each part on its own instead of their union
                # avoids torch.unique (a host sync on CUDA); columns in both are written twice, alike.
                keeps = [cur] if pending.sel[s.name] is cur else [pending.sel[s.name], cur]
                p = s.param
                saved = [p.index_select(1, keep) for keep in keeps]
                if s.landing is not None:
                    p.copy_(s.landing)
                else:
                    src = s.store.shaped(s.store.result(pending.acc_index), s.index)
                    p.copy_(src)
                    stats.bytes_h2d += src.numel() * src.element_size()
                for keep, vals in zip(keeps, saved, strict=True):
                    p.index_copy_(1, keep, vals)
            stats.bytes_h2d += pending.h2d_bytes
            stats.bytes_gathered += gathered
            self.merge_done = self.ops.record()
        stats.cpu_optimizer_seconds += float(seconds)
        stats.applied_cpu_update = True
        self.pending = None

    def _apply_stash(self, stats: StepStats) -> None:
        """CPU master of columns dropped at the previous reselection := their last device values
        (copied off the device now, into transient host memory)."""
        for st in self.stash_groups:
            cols, mask, values = self._stash_to_host(st)
            stats.bytes_d2h += sum(t.numel() * t.element_size() for t in (cols, mask, values))
            for j, name in enumerate(st.names):
                keep = mask[j]
                self._write_master(name, cols[j][keep], values[j][:, keep])
        for name, (cols, vals) in self.stash.items():
            self._write_master(name, cols, vals)
        self.stash_groups, self.stash = [], {}

    def _write_master(self, name: str, cols: torch.Tensor, vals: torch.Tensor) -> None:
        s = self.by_name[name]
        if not s.store.sharded:
            s.store.shaped(s.store.master, s.index).index_copy_(1, cols, vals)
            return
        if s.store.numels[s.index] == 0:
            return
        rows, r0, start, n = s.store.rows_view(s.store.master, s.index)  # the shard's rows only
        rows.index_copy_(1, cols, vals[r0 : r0 + rows.shape[0]])
        s.store.unrows(s.store.master, s.index, rows, start, n)

    def _stash_to_host(self, st: _Stash) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.ops.host
        out = (
            h.scratch(st.cols.numel(), torch.int64).view(st.cols.shape),
            h.scratch(st.mask.numel(), torch.bool).view(st.mask.shape),
            h.scratch(st.values.numel(), torch.float32).view(st.values.shape),
        )
        self.ops.d2h(list(zip(out, (st.cols, st.mask, st.values), strict=True)), ready=st.ready).wait()
        return out

    def _reselect_due(self) -> bool:
        si = self.cfg.select_interval
        if si == "auto":
            if self.epoch_seen:
                return self.epoch_flag
            return self.since_select >= self.cfg.select_interval_fallback
        return self.since_select >= int(si)

    def _reselect(self, stats: StepStats) -> None:
        for d in self.dev.reselect(self._values_from_master(stats), given_scores=self._scores(stats)):
            self._stash_out(d, stats)
        self.reselections += 1
        self.since_select = 0
        self.epoch_flag = False

    def _stash_out(self, d: Dropped, stats: StepStats) -> None:
        """Keep a group's old columns, dropped mask and values on the device until the next boundary."""
        self.stash_groups.append(_Stash(d.names, d.cols, d.mask, d.values, self.ops.record()))

    def _current_selection(self) -> dict[str, torch.Tensor]:
        sel = {}
        for s in self.splits:
            cols = self.dev.columns(s.name)
            assert cols is not None
            sel[s.name] = cols  # reselection replaces the index tensor, never mutates it
        return sel

    def _submit_window(self, lr: float, stats: StepStats, sel: dict[str, torch.Tensor]) -> None:
        """Queue the CPU AdamW step on the window's accumulated gradient (and, on CUDA, its prefetch).

        ``sel``: the selection the window ran under (kept by the device at the merge, with the then
        current one).
        """
        assert self.worker is not None
        cfg = self.cfg
        acc_i = self._acc_index()
        n = self.win_len
        scale = 1.0 / n if cfg.update_interval == "auto" and n > 1 else None
        # scale_cpu_lr: the window's steps' learning rates summed (= lr * n at a constant lr; the sum, not
        # lr * n at the boundary, which would overshoot during warm-up).
        win_lr = self.win_lr if self.win_lr == self.win_lr else lr * n  # NaN: restored from an old state
        cpu_lr = win_lr if cfg.scale_cpu_lr else lr
        by_store = {id(st): {s.index: s for s in self.splits if s.store is st} for st in self.stores}
        after = self.merge_done
        ops = self.ops
        h2d_bytes = sum(s.param.numel() * s.param.element_size() for s in self.splits) if ops.is_cuda else 0
        acc_copies = []
        if self.on_device:  # the window's gradient leaves the device once, now
            for store in self.stores:
                # rounded to the parameters' dtype on the way (on the device, in transient memory)
                pairs = [
                    (store.flat(store.bufs[acc_i], s.index), store.piece(s.dacc, s.index))
                    for s in self.splits
                    if s.store is store and s.dacc is not None
                ]
                t_acc = ops.d2h(pairs)
                stats.bytes_d2h += t_acc.nbytes
                acc_copies.append(t_acc)
                self.dacc_free = t_acc.event

        def run() -> Any:
            busy = 0.0
            last = None
            first_copy = True
            with gil_released():
                for t_acc in acc_copies:
                    t_acc.wait()
            t = time.perf_counter()
            for store in self.stores:
                acc = store.bufs[acc_i]
                if scale is not None:
                    acc.mul_(scale)
                for done in store.adam(
                    acc,
                    lr=cpu_lr,
                    betas=cfg.betas,
                    eps=cfg.eps,
                    weight_decay=cfg.weight_decay,
                    num_threads=self.threads,
                    chunk=cfg.cpu_chunk_elements,
                ):
                    if (
                        done and ops.is_cuda and not self.gathers
                    ):  # prefetch finished params' results, batched
                        pairs = []
                        for i in done:
                            landing = by_store[id(store)][i].landing
                            assert landing is not None
                            pairs.append((landing, store.flat(store.result(acc_i), i)))
                        last = ops.h2d(pairs, after=after if first_copy else None)
                        first_copy = False
                    busy += time.perf_counter() - t
                    yield
                    t = time.perf_counter()
            busy += time.perf_counter() - t
            if last is not None:
                with gil_released():
                    last.wait()
            gathered = 0
            if self.gathers and not ops.is_cuda:
                gathered = self._gather_results(acc_i)
            elif self.gathers:  # NCCL: the training thread gathers at the boundary (see _collect)
                for si in range(len(self.stores)):
                    self._upload_shard(si, acc_i)
            return busy, gathered

        self.pending = _Pending(self.worker.submit(run), sel, h2d_bytes, acc_i)

    def _gather_results(self, acc_i: int, group: Any = None) -> int:
        """Process group: upload this rank's updated shard of every store and all-gather every rank's
        into the replica the landing buffers view (the worker thread's own group unless ``group``)."""
        return sum(self._gather_store(si, acc_i, group) for si in range(len(self.stores)))

    def _upload_shard(self, si: int, acc_i: int) -> None:
        store, gather = self.stores[si], self.gathers[si]
        t = self.ops.h2d([(gather.mine.narrow(0, 0, store.numel), store.result(acc_i))])
        with gil_released():
            t.wait()

    def _gather_store(self, si: int, acc_i: int, group: Any = None) -> int:
        self._upload_shard(si, acc_i)
        return self._all_gather(si, group)

    def _all_gather(self, si: int, group: Any = None) -> int:
        n = self.gathers[si].gather(self.ranks.side if group is None else group)
        if self.ops.is_cuda:  # the gathered values are final before another stream reads them
            with gil_released():
                torch.cuda.current_stream(self.ops.device).synchronize()
        return n

    # --- warm-up --------------------------------------------------------------------------------
    def _synchronous_update(self, stats: StepStats, lr: float) -> None:
        """Offload-style synchronous CPU update of the split params (warm-up rounds)."""
        if not self.splits:
            return
        assert self.worker is not None
        cfg = self.cfg
        with stats.blocked():
            for si, store in enumerate(self.stores):
                members = [s for s in self.splits if s.store is store and s.param.grad is not None]
                staging = store.bufs[0]  # no window is open during the warm-up
                if self.step_shards is not None:  # this rank's shard of the mean
                    pairs = [(staging, self.step_shards[si])]
                else:  # members have a gradient
                    pairs = [
                        (
                            store.flat(staging, s.index),
                            store.piece(cast("torch.Tensor", s.param.grad), s.index),
                        )
                        for s in members
                    ]
                t = self.ops.d2h(pairs)
                stats.bytes_d2h += t.nbytes
                only = [s.index for s in members]

                def run(store: HostStore = store, t: Any = t, only: list[int] = only) -> float:
                    with gil_released():
                        t.wait()
                    return store.adam_now(
                        store.bufs[0], config=cfg, lr=lr, num_threads=self.threads, only=only
                    )

                stats.cpu_optimizer_seconds += float(self.worker.wait(self.worker.submit(run)))
                if self.gathers:  # every rank's updated shard into the replica (no window is in flight)
                    stats.bytes_gathered += self._gather_store(si, 0, self.ranks.group)
                    for s in members:
                        assert s.landing is not None
                        s.param.data.copy_(s.landing)
                    continue
                h = self.ops.h2d([(s.param.data, store.flat(store.result(0), s.index)) for s in members])
                h.wait()
                stats.bytes_h2d += h.nbytes
        stats.applied_cpu_update = True

    # --- end of training / inspection -----------------------------------------------------------
    @torch.no_grad()
    def flush(self, stats: StepStats, lr: float) -> None:
        self.check()
        if not self.started or self.worker is None:
            return
        if self.win_len > 0:
            self._boundary(stats, lr, sync=True, reselect=False)
        if self.pending is not None:
            self._collect(stats)
        with stats.blocked():
            self._apply_stash(stats)

    def selection(self) -> dict[str, torch.Tensor]:
        """Current selected columns of each split param (CPU tensors; empty before the first selection)."""
        out = {}
        for s in self.splits:
            if self.started:
                cols = self.dev.columns(s.name)
                assert cols is not None
                out[s.name] = cols.cpu()
        return out

    @torch.no_grad()
    def consolidated(self) -> dict[str, torch.Tensor]:
        out = {n: p.detach().to("cpu", copy=True) for n, p in self.named}
        pending = self.pending
        if pending is None or self.worker is None:
            return out
        self.worker.wait(pending.future)
        for s in self.splits:
            cur = self.dev.columns(s.name)
            assert cur is not None
            keep = union(pending.sel[s.name], cur).cpu()
            take = torch.ones(s.param.shape[1], dtype=torch.bool)
            take[keep] = False
            cols = take.nonzero().squeeze(1)
            if self.gathers:  # the gathered replica (this rank holds only a shard of the result)
                assert s.landing is not None
                res = s.landing.cpu()
            else:
                res = s.store.shaped(s.store.result(pending.acc_index), s.index)
            out[s.name][:, cols] = res.index_select(1, cols).to(out[s.name].dtype)
        return out

    # --- sizes ----------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        return self.dev.state_bytes()

    def buffer_bytes(self) -> int:
        total = sum(g.nbytes() for g in self.gathers)
        for s in self.splits:
            for t in (s.dacc,) if self.gathers else (s.landing, s.dacc):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    def memory(self) -> EngineMemory:
        host = add_parts([st.parts() for st in self.stores])
        if self.stores:
            host["transfer"] = sum(nbytes(t) for ring in self.rings if ring is not None for t in ring)
        state, scratch = self.dev.memory_parts()
        buffers = {
            "landing": sum(g.nbytes() for g in self.gathers)
            if self.gathers
            else sum(nbytes(s.landing) for s in self.splits),
            "accumulator": sum(nbytes(s.dacc) for s in self.splits),
            "stash": sum(nbytes(st.values) for st in self.stash_groups),
            "column_scratch": scratch,
        }
        return EngineMemory(self.name, self.params(), host=host, device_state=state, device_buffers=buffers)

    # --- persistence ----------------------------------------------------------------------------
    def _drain(self) -> None:
        if self.worker is not None:
            self.worker.drain()

    def state_dict(self) -> dict[str, Any]:
        self._drain()
        acc_index = self._acc_index() if self.win_len > 0 and not self.on_device else None
        pending = None
        if self.pending is not None:
            pending = {
                "sel": {n: c.cpu().clone() for n, c in self.pending.sel.items()},
                "seconds": float(self.pending.future.result()[0]),
            }
        return {
            "mode": self.name,
            "device_params": self.device_params_state(),
            "device_optimizer": self.dev.state_dict(),
            "host": [st.state_dict(acc_index) for st in self.stores],
            "pending": pending,
            "stash": self._stash_by_name(),
            "device_acc": {
                s.name: s.dacc.to("cpu", copy=True)
                for s in self.splits
                if s.dacc is not None and self.win_len > 0
            },
            "schedule": {
                "warm_left": self.warm_left,
                "started": self.started,
                "window": self.window,
                "win_len": self.win_len,
                "win_lr": self.win_lr,
                "since_select": self.since_select,
                "win_sel": self.win_sel,
                "win_unsel": self.win_unsel,
                "epoch_seen": self.epoch_seen,
                "epoch_flag": self.epoch_flag,
            },
        }

    def _stash_by_name(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {n: (c.clone(), v.clone()) for n, (c, v) in self.stash.items()}
        for st in self.stash_groups:
            cols, mask, values = self._stash_to_host(st)
            for j, name in enumerate(st.names):
                keep = mask[j]
                out[name] = (cols[j][keep].clone(), values[j][:, keep].clone())
        return out

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any], host_shards: list[list[Any]] | None = None) -> None:
        """``host_shards``: per host store, the states of every shard of a group of another size
        (:meth:`load_shards`); ``sd``'s own host states otherwise."""
        self._drain()
        self.load_device_params(sd["device_params"])
        sched = sd["schedule"]
        self.dev = self._new_device_optimizer()
        dev_sd = sd["device_optimizer"]
        if sched["started"]:
            for s in self.splits:
                self.dev.add_columns(s.name, s.param, torch.as_tensor(dev_sd[s.name]["cols"]))
        self.dev.load_state_dict(dev_sd)
        if host_shards is not None:
            for st, shards in zip(self.stores, host_shards, strict=True):
                st.load_shards(shards)
        else:
            for st, hs in zip(self.stores, sd["host"], strict=True):
                st.load_state_dict(hs)
        self.win_lr = float("nan")  # states saved before win_lr existed: lr * win_len at the boundary
        for key, value in sched.items():
            setattr(self, key, value)
        self.stash = {n: (torch.as_tensor(c), torch.as_tensor(v)) for n, (c, v) in sd["stash"].items()}
        self.stash_groups = []
        for name, t in sd.get("device_acc", {}).items():
            dacc = self.by_name[name].dacc
            assert dacc is not None
            dacc.copy_(t)
        self.slot, self.slot_futs, self.merge_done, self.dacc_free = 0, [None, None], None, None
        self.pending = None
        p = sd["pending"]
        if p is not None:
            fut: Future[Any] = Future()
            fut.set_result((float(p["seconds"]), 0))
            sel = {n: torch.as_tensor(c).to(self.ops.device) for n, c in p["sel"].items()}
            h2d_bytes = 0
            acc_index = (self.window - 1) % (1 if self.on_device else 2)  # the window before the current one
            for store in self.stores:
                store.restore_result(acc_index)
            if self.gathers:  # every rank's shard of the result into the replica again
                self._gather_results(acc_index, group=self.ranks.group)
            elif self.ops.is_cuda:  # re-issue the prefetch the saved run had already made
                pairs = [(s.landing, s.store.flat(s.store.result(acc_index), s.index)) for s in self.splits]
                t = self.ops.h2d(cast("list[tuple[torch.Tensor, torch.Tensor]]", pairs))  # CUDA: landing set
                t.wait()
                h2d_bytes = t.nbytes
            self.pending = _Pending(fut, sel, h2d_bytes, acc_index)

    def load_shards(self, sds: list[dict[str, Any]]) -> None:
        """Another group size: the replicated state from the first rank's, the host stores re-cut."""
        if len(sds[0]["host"]) != len(self.stores):
            raise ValueError("engine state does not match the model's parameter groups")
        self.load_state_dict(
            sds[0], host_shards=[[sd["host"][i] for sd in sds] for i in range(len(self.stores))]
        )

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.ops.release()

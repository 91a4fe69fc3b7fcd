"""``zenflow`` mode: the step orchestration and the window schedule (the semantics are in
:mod:`offload.zenflow`'s docstring).

:class:`ZenFlowMode` keeps the schedule (warm-up rounds left, the window's index, length, learning
rates and "adaptive" masses, steps since the selection, the epoch signal) and the CPU result in flight,
and drives its parts in order each step: the reduction (:mod:`offload.zenflow.reduction`), the device
optimizer (:mod:`offload.zenflow.selective_adamw`), the accumulation
(:mod:`offload.zenflow.accumulation`) and, at a boundary, the window update
(:mod:`offload.zenflow.window`) with the reselection's handover (:mod:`offload.zenflow.handover`).
"""

from __future__ import annotations

from typing import Any

import torch

from offload.clipping import grad_norms
from offload.collectives import EngineGroup, Reduced
from offload.config import EngineConfig
from offload.cpu_thread import CPUThread
from offload.device import DeviceOps, Landing
from offload.fsdp import all_sum_, column_scores_
from offload.guard import Gate
from offload.memory import EngineMemory, is_split
from offload.mode_base import Mode, NamedParams, add_parts, nbytes
from offload.selection import union
from offload.timing import StepStats
from offload.zenflow.accumulation import Accumulation, Staged
from offload.zenflow.adamw import AdamWHyper
from offload.zenflow.handover import Handover
from offload.zenflow.layout import HostLayout
from offload.zenflow.reduction import ShardReduction
from offload.zenflow.selective_adamw import SelectiveAdamW
from offload.zenflow.window import Pending, WindowUpdate


class ZenFlowMode(Mode):
    name = "zenflow"

    def __init__(
        self,
        named: NamedParams,
        cfg: EngineConfig,
        ops: DeviceOps,
        ranks: EngineGroup | None = None,
        *,
        threads: int,
        optimizer_cores: list[int] | None,
    ) -> None:
        super().__init__(named, cfg, ops, ranks)
        self.threads = threads
        self.hyper = AdamWHyper(cfg.lr, cfg.betas[0], cfg.betas[1], cfg.eps, cfg.weight_decay)
        split_named = [(n, p) for n, p in named if is_split(p.shape, cfg.topk_ratio)]
        self.full_names = [n for n, p in named if not is_split(p.shape, cfg.topk_ratio)]
        self.on_device = cfg.accumulate_on == "device"
        self.layout = HostLayout(split_named, cfg, ops, self.ranks, on_device=self.on_device)
        self.splits, self.stores = self.layout.splits, self.layout.stores
        self.dev = self._new_device_optimizer()
        if self.splits:
            self.cpu_thread = CPUThread(
                torch_threads=threads, cores=optimizer_cores, cuda_device=ops.device if ops.is_cuda else None
            )
        self.reduction = ShardReduction(named, self.layout, ops, self.ranks, on_device=self.on_device)
        self.accumulation = Accumulation(
            self.layout, ops, self.cpu_thread, cfg, threads=threads, on_device=self.on_device
        )
        self.window_update = WindowUpdate(self.layout, ops, self.ranks, self.cpu_thread, cfg, threads=threads)
        self.handover = Handover(self.layout, ops, self.ranks)
        # Schedule state.
        self.warm_left = cfg.full_warm_up_rounds
        self.started = False
        self.window = 0  # index of the current window (parity picks its accumulator)
        self.win_len = 0  # steps accumulated in the current window
        self.win_lr = 0.0  # sum of the learning rates of those steps (scale_cpu_lr)
        self.since_select = 0
        self.reselections = 0  # reselections after the first selection (not persisted)
        self.win_sel = 0.0  # "adaptive": summed selected / unselected squared norms in the window
        self.win_unsel = 0.0
        self.epoch_seen = False  # the caller has called new_epoch() at least once
        self.epoch_flag = False  # ... and not since the last selection
        #: The CPU result of the previous window, not merged yet.
        self.pending: Pending | None = None

    def reduce(self, stats: StepStats) -> Reduced:
        """Reduce-scatter where only the host needs the gradient, else all-reduce every gradient
        (:mod:`offload.zenflow.reduction` says when)."""
        columns = self.dev.columns if self.started else None
        reduced = self.reduction.reduce(stats, columns, warming=self.warm_left > 0)
        return reduced if reduced is not None else super().reduce(stats)

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
        if self.cpu_thread is not None:
            self.cpu_thread.check()

    def new_epoch(self) -> None:
        self.epoch_seen = True
        self.epoch_flag = True

    @torch.no_grad()
    def step(self, stats: StepStats, lr: float, gate: Gate) -> None:
        self.check()
        if self.warm_left > 0:
            self._warm_up_step(stats, lr, gate)
            return
        if not self.splits:
            self.dev.step(lr, gate)
            return
        starting = not self.started
        if starting:
            self._start(stats)
        staged, masses = self._queue_device_work(stats, lr, gate)
        # 2. host bookkeeping, from the verdict (landed by now: no wait)
        ok = gate.finite()
        if staged is not None:
            self.accumulation.queue(
                staged, ok, first=self.win_len == 0, acc_i=self._acc_index(), factor=gate.host_factor()
            )
        if not ok:
            if starting:  # nothing was updated: select afresh from the next step's gradient
                self.dev.reset_columns()
                self.started = False
            return
        if self._count_step(lr, masses):
            self._boundary(stats, lr, sync=not self.cfg.overlap_step, reselect=True)

    def _warm_up_step(self, stats: StepStats, lr: float, gate: Gate) -> None:
        """A warm-up round: the device's AdamW on the full weights, the CPU's on the split ones at once."""
        self.dev.step(lr, gate)
        stats.synchronous = True
        if gate.finite():  # a synchronous step: the host waits for its verdict anyway
            self.window_update.synchronous(stats, lr, self.reduction.shards, gate.host_factor())
            self.warm_left -= 1

    def _queue_device_work(
        self, stats: StepStats, lr: float, gate: Gate
    ) -> tuple[Staged | None, Landing | None]:
        """1. The step's device work, gated on the device (nothing here waits for the verdict): the
        split gradients staged for the host (host accumulation), the device optimizer, the device
        accumulation; the gradient masses on their way to the host ("adaptive")."""
        staged = None
        if not self.on_device:
            # Both only read the (clipped) gradients: the copy off the device starts before the
            # device optimizer's kernels, not after them.
            staged = self.accumulation.stage(stats, self.reduction.shards)
        sq = self.dev.prepare(gate, want_sq=self.cfg.update_interval == "adaptive")
        masses = self._masses(sq, gate) if sq is not None else None
        self.dev.update(lr)
        if self.on_device:
            self.accumulation.add_on_device(gate, first=self.win_len == 0)
        return staged, masses

    def _count_step(self, lr: float, masses: Landing | None) -> bool:
        """Count a finite step into the window; whether the window ends with it."""
        self.win_len += 1
        self.win_lr += lr
        self.since_select += 1
        if masses is not None:
            return self._auto_window_ends(masses)
        return self.win_len >= int(self.cfg.update_interval)

    def _masses(self, sq: tuple[torch.Tensor, torch.Tensor], gate: Gate) -> Landing:
        """Start copying this step's selected and unselected gradient masses to the host ("adaptive"; fp16
        gradients times the gate's factor, as the device optimizer sees them)."""
        full_sq, cols_sq = sq  # the device's gradient parts: whole tensors, selected columns
        grads = [g for g in (s.param.grad for s in self.splits) if g is not None]
        if self.reduction.shards is not None:  # .grad holds the mean in the selected columns only
            total_split = self.reduction.split_sq()
            f = gate.grad_factor
            if f is not None and all(st.dtype == torch.float16 for st in self.stores):
                total_split = total_split * f.square()
        elif grads:
            total_split = grad_norms(grads, gate.grad_factor).square().sum()
        else:
            total_split = torch.zeros((), device=cols_sq.device)
        pair = [full_sq + cols_sq, (total_split - cols_sq).clamp(min=0)]
        if self.row_group is not None:  # row blocks (offload.fsdp): every rank decides on the whole model's
            pair = list(all_sum_(torch.stack(pair), self.row_group).unbind())
        return self.ops.read_later(pair)

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
        self.dev.reselect(
            self.handover.values_from_master(stats), fresh=True, given_scores=self._scores(stats)
        )
        self.started = True
        self.since_select = 0
        self.epoch_flag = False

    def before_zero_grad(self) -> None:
        """The gradients are about to be zeroed in place: let the CPU thread finish reading them."""
        self.accumulation.wait_reads()

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
            self.handover.apply(stats)
            if reselect and self._reselect_due():
                self._reselect(stats)
        self._submit_window(lr, stats, window_sel)
        if sync:  # no staleness: this window's result goes in now (the training thread waits for it)
            self._collect(stats)
            with stats.blocked():
                self.handover.apply(stats)
        self.window += 1
        self.win_len = 0
        self.win_lr = 0.0
        self.win_sel = self.win_unsel = 0.0

    def _collect(self, stats: StepStats) -> None:
        """Wait for the pending CPU result and merge it into the device weights."""
        assert self.pending is not None
        self.window_update.collect(self.pending, stats, self.dev.columns)
        self.pending = None

    def _reselect_due(self) -> bool:
        si = self.cfg.select_interval
        if si == "epoch":
            if self.epoch_seen:
                return self.epoch_flag
            return self.since_select >= self.cfg.select_interval_fallback
        return self.since_select >= int(si)

    def _reselect(self, stats: StepStats) -> None:
        values = self.handover.values_from_master(stats)
        for d in self.dev.reselect(values, given_scores=self._scores(stats)):
            self.handover.stash_out(d)
        self.reselections += 1
        self.since_select = 0
        self.epoch_flag = False

    def _scores(self, stats: StepStats) -> dict[str, torch.Tensor] | None:
        """Column scores computed across ranks (the reduced shards' in a process group, the row blocks'
        over FSDP2), or None: each weight's own gradient's."""
        if self.row_group is not None:
            return column_scores_([(s.name, s.param) for s in self.splits], self.row_group)
        return self.reduction.scores(stats)

    def _current_selection(self) -> dict[str, torch.Tensor]:
        sel = {}
        for s in self.splits:
            cols = self.dev.columns(s.name)
            assert cols is not None
            sel[s.name] = cols  # reselection replaces the index tensor, never mutates it
        return sel

    def _submit_window(self, lr: float, stats: StepStats, sel: dict[str, torch.Tensor]) -> None:
        """Queue the CPU AdamW step on the window's accumulated gradient (``sel``: the selection the
        window ran under)."""
        cfg = self.cfg
        acc_i = self._acc_index()
        n = self.win_len
        scale = 1.0 / n if cfg.update_interval == "adaptive" and n > 1 else None
        # scale_cpu_lr: the window's steps' learning rates summed (= lr * n at a constant lr; the sum, not
        # lr * n at the boundary, which would overshoot during warm-up).
        win_lr = self.win_lr if self.win_lr == self.win_lr else lr * n  # NaN: restored from an old state
        cpu_lr = win_lr if cfg.scale_cpu_lr else lr
        # device accumulation: the window's gradient leaves the device once, now
        copies = self.accumulation.to_host(acc_i, stats) if self.on_device else []
        self.pending = self.window_update.submit(acc_i, cpu_lr, scale, sel, copies)

    # --- end of training / inspection -----------------------------------------------------------
    @torch.no_grad()
    def flush(self, stats: StepStats, lr: float) -> None:
        self.check()
        if not self.started or self.cpu_thread is None:
            return
        if self.win_len > 0:
            self._boundary(stats, lr, sync=True, reselect=False)
        if self.pending is not None:
            self._collect(stats)
        with stats.blocked():
            self.handover.apply(stats)

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
        """The weights with the pending CPU result merged in. NCCL: collective while that result's
        all-gather is still to run (:meth:`_gather_pending`; ``state_dict()`` runs it, so a rank-0-only
        export after a checkpoint's ``state_dict()`` on every rank needs no collective)."""
        out = {n: p.detach().to("cpu", copy=True) for n, p in self.named}
        if self.pending is not None and self.cpu_thread is not None:
            self.window_update.merged(self.pending, out, self.dev.columns)
        return out

    def _gather_pending(self) -> None:
        """NCCL: the pending CPU result into every rank's replica now, on the training thread (no-op
        otherwise), so the state saved and the weights exported next include the last window."""
        if self.pending is not None and self.cpu_thread is not None:
            self.window_update.gather_pending(self.pending)

    # --- sizes ----------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        return self.dev.state_bytes()

    def buffer_bytes(self) -> int:
        return self.layout.buffer_bytes()

    def memory(self) -> EngineMemory:
        host = add_parts([st.parts() for st in self.stores])
        if self.stores:
            rings = self.accumulation.rings
            host["transfer"] = sum(nbytes(t) for ring in rings if ring is not None for t in ring)
        state, scratch = self.dev.memory_parts()
        buffers = {
            **self.layout.device_buffers(),
            "stash": self.handover.stash_bytes(),
            "column_scratch": scratch,
        }
        return EngineMemory(self.name, self.params(), host=host, device_state=state, device_buffers=buffers)

    # --- persistence ----------------------------------------------------------------------------
    @torch.no_grad()
    def consolidated_one(self, name: str) -> torch.Tensor:
        """:meth:`consolidated`'s value of parameter ``name`` alone, as ``WindowUpdate.merged`` makes
        it (the pending CPU result outside the device's columns), built from one copy of the result
        with the kept columns put back: a streamed export holds about one weight at a time."""
        s = next((s for s in self.splits if s.name == name), None)
        pending = self.pending if self.cpu_thread is not None else None
        if s is None or pending is None:
            return super().consolidated_one(name)
        assert self.cpu_thread is not None
        self.cpu_thread.wait(pending.future)
        cur = self.dev.columns(s.name)
        assert cur is not None
        keep = union(pending.sel[s.name], cur)
        if self.layout.gathers:  # the gathered replica (this rank holds only a shard of the result)
            assert s.landing is not None
            out = s.landing.to("cpu", dtype=s.param.dtype, copy=True)
        else:
            res = s.store.shaped(s.store.result(pending.acc_index), s.index)
            out = res.to("cpu", dtype=s.param.dtype, copy=True)
        out[:, keep.cpu()] = s.param.detach().index_select(1, keep).cpu()
        return out

    def _drain(self) -> None:
        if self.cpu_thread is not None:
            self.cpu_thread.drain()

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        self._drain()
        self._gather_pending()
        open_window = self.win_len > 0
        acc = self._acc_index() if open_window and not self.on_device else None
        # copy=False: the host stores, parameters and device accumulators themselves (the rest is small)
        device_acc = (
            self.accumulation.device_state()
            if copy
            else {s.name: s.dacc for s in self.layout.splits if s.dacc is not None}
        )
        return {
            "mode": self.name,
            "device_params": self.device_params_state(copy),
            "device_optimizer": self.dev.state_dict(copy),
            "host": [st.state_dict(acc, copy=copy) for st in self.stores],
            "pending": WindowUpdate.pending_state(self.pending),
            "stash": self.handover.state_dict(),
            "device_acc": device_acc if open_window else {},
            "schedule": {key: getattr(self, key) for key in _SCHEDULE},
        }

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
        self.handover.load_state_dict(sd["stash"])
        self.accumulation.load_device_state(sd.get("device_acc", {}))
        self.accumulation.reset()
        self.window_update.merge_done = None
        self.pending = None
        if sd["pending"] is not None:  # its CPU step ran into the window before the current one
            acc_index = (self.window - 1) % (1 if self.on_device else 2)
            self.pending = self.window_update.restore(sd["pending"], acc_index)

    def load_shards(self, sds: list[dict[str, Any]]) -> None:
        """Another group size: the replicated state from the first rank's, the host stores re-cut."""
        if len(sds[0]["host"]) != len(self.stores):
            raise ValueError("engine state does not match the model's parameter groups")
        self.load_state_dict(
            sds[0], host_shards=[[sd["host"][i] for sd in sds] for i in range(len(self.stores))]
        )

    def close(self) -> None:
        if self.cpu_thread is not None:
            self.cpu_thread.close()
        self.ops.release()


#: The schedule's persisted counters (a state dict's "schedule"; ``reselections`` is not persisted).
_SCHEDULE = (
    "warm_left",
    "started",
    "window",
    "win_len",
    "win_lr",
    "since_select",
    "win_sel",
    "win_unsel",
    "epoch_seen",
    "epoch_flag",
)

"""``zenflow`` mode: important columns on the device every step, the rest on the CPU in the background.

Parameters. A 2-D weight with ``k = ceil(topk_ratio * cols) < cols`` is *split*: its selected
columns (:mod:`offload.selection`) are updated on the device every step by
:class:`~offload.selective_adamw.SelectiveAdamW`; the whole weight also lives on the host (fp32
master, fp32 moments, :class:`~offload.host.HostStore`). Everything else (1-D params, and 2-D weights
whose every column is selected, e.g. ``topk_ratio=1``) is owned by the device optimizer outright.

Windows. Steps are grouped into windows ``v = 1, 2, ...`` of ``update_interval`` steps (or "auto",
below); the selection ``S_v`` is fixed within a window. Every step, after global clipping:

1. the device updates the selected columns (and the device-only params);
2. the split params' whole gradients are copied to a pinned staging slot (double-buffered; async on
   a side stream on CUDA) and the worker adds them into the window's fp32 accumulator
   (``acc[v % 2]``; each step's gradient times ``1/update_interval``, so the accumulator holds the
   window *mean*; for "auto" the sum is divided by the window length at the boundary).
   With ``accumulate_on="device"`` the gradients are instead added into an fp32 accumulator on the
   device, which is copied into ``acc[v % 2]`` (async, D2H stream) once, at the boundary.

At the boundary ending window ``v`` the training thread:

a. waits for ``R_{v-1}``, the CPU AdamW result of the previous window (the only possible stall),
   and merges it into the device weights except the columns in ``S_{v-1} | S_v`` (union), where the device
   value wins (the device updated them, or the CPU result for them is void). ``S_{v-1}`` is the
   selection window ``v - 1`` ran under, not the one chosen at its end: a column dropped there was
   the device's, and the CPU master only gets its value in (b), after ``R_{v-1}`` was computed;
b. writes into the CPU master the stashed device values of the columns dropped from the selection
   at the previous boundary (the device was authoritative for them; this must wait for ``R_{v-1}``);
c. reselects if due (``select_interval`` steps since the last selection; "auto": when the caller
   called ``new_epoch()``, or every ``select_interval_fallback`` steps if it never does). Columns
   that stay keep their device moments; new columns start at zero moments, step 0, their fp32
   device master taken from the CPU master; dropped columns' newest fp32 values are stashed for (b);
d. submits AdamW on the window's mean gradient to the worker: one CPU step per window, at the sum
   of the learning rates of the window's steps (``scale_cpu_lr``, default: the linear scaling rule,
   ``lr * window length`` at a constant lr, so unselected weights travel as far per training step as
   selected ones, also while the schedule warms up or decays) or at the lr current at the boundary.
   On CUDA the worker then prefetches the result into device landing buffers on the H2D stream, so
   (a) at the next boundary is a device-to-device copy.

So the unimportant weights are exactly one window stale: the update from window ``v``'s gradients
reaches the model at the end of window ``v + 1``. A column that becomes selected loses the CPU
update of the window it was selected in (the device takes over from its value at that boundary).

"auto" window length: a window ends when the summed squared norm of the unselected gradient over
the window reaches the mean squared norm of the selected gradient per step, i.e. when the update
waiting on the CPU weighs as much as one step of what the device applies; at most
``max_update_interval`` steps. Warm-up: the first ``full_warm_up_rounds`` steps update the split
params synchronously on the CPU (offload style) and select nothing.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, cast

import torch

from offload.config import EngineConfig
from offload.device import DeviceOps
from offload.host import HostStore
from offload.mode_base import Mode, NamedParams
from offload.offload_mode import group_by_dtype
from offload.selection import num_selected, select_columns, union
from offload.selective_adamw import AdamWHyper, SelectiveAdamW
from offload.timing import StepStats
from offload.worker import Worker


@dataclass(slots=True)
class _Split:
    name: str
    param: torch.nn.Parameter
    store: HostStore
    index: int  # position inside ``store``
    k: int
    landing: torch.Tensor | None  # device buffer the CPU result is prefetched into (CUDA)
    dacc: torch.Tensor | None  # fp32 device accumulator (accumulate_on="device")
    staging: list[torch.Tensor]  # this param's (shaped) view of each of the store's staging slots


@dataclass(slots=True)
class _Pending:
    future: Future[Any]
    #: The selection of the window this result was computed for (its columns are void in the result).
    sel: dict[str, torch.Tensor]
    h2d_bytes: int


class ZenFlowMode(Mode):
    name = "zenflow"

    def __init__(
        self,
        named: NamedParams,
        cfg: EngineConfig,
        ops: DeviceOps,
        *,
        threads: int,
        worker_cores: list[int] | None,
    ) -> None:
        super().__init__(named, cfg, ops)
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
        slots = 2 if not self.on_device else (1 if cfg.full_warm_up_rounds else 0)
        self.splits: list[_Split] = []
        self.stores: list[HostStore] = []
        for group in group_by_dtype(split_named):
            # host accumulation fills window v+1's accumulator while the worker reads window v's
            accs = 1 if self.on_device else 2
            store = HostStore([p for _, p in group], ops.host, staging_slots=slots, accumulators=accs)
            self.stores.append(store)
            for i, (n, p) in enumerate(group):
                like = p.detach()
                landing = torch.empty_like(like) if ops.is_cuda else None
                dacc = torch.zeros(like.shape, dtype=torch.float32, device=like.device) if self.on_device else None
                k = num_selected(p.shape[1], cfg.topk_ratio)
                staging = [store.shaped(buf, i) for buf in store.staging]
                self.splits.append(_Split(n, p, store, i, k, landing, dacc, staging))
        self.by_name = {s.name: s for s in self.splits}
        self.dev = self._new_device_optimizer()
        self.worker: Worker | None = None
        if self.splits:
            self.worker = Worker(
                torch_threads=threads, cores=worker_cores, cuda_device=ops.device if ops.is_cuda else None
            )
        # Schedule state.
        self.warm_left = cfg.full_warm_up_rounds
        self.started = False
        self.window = 0  # index of the current window (parity picks its accumulator)
        self.win_len = 0  # steps accumulated in the current window
        self.win_lr = 0.0  # sum of the learning rates of those steps (scale_cpu_lr)
        self.since_select = 0
        self.win_sel = 0.0  # "auto": summed selected / unselected squared norms in the window
        self.win_unsel = 0.0
        self.epoch_seen = False  # the caller has called new_epoch() at least once
        self.epoch_flag = False  # ... and not since the last selection
        self.pending: _Pending | None = None
        self.stash: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.slot = 0
        self.slot_futs: list[Future[Any] | None] = [None, None]
        self.merge_done: torch.cuda.Event | None = None
        self.dacc_free: torch.cuda.Event | None = None  # the last device-accumulator copy has been read

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
    def step(self, stats: StepStats, lr: float) -> None:
        self.check()
        if self.warm_left > 0:
            self.dev.step(lr)
            self._synchronous_update(stats, lr)
            self.warm_left -= 1
            stats.synchronous = True
            return
        if not self.splits:
            self.dev.step(lr)
            return
        if not self.started:
            self._start(stats)
        auto = self.cfg.update_interval == "auto"
        if self.on_device:
            sel_sq = self.dev.step(lr, want_sq=auto)
            self._accumulate_on_device()
        else:
            # Both only read the (clipped) gradients: the copy off the device starts before the
            # device optimizer's kernels, not after them.
            self._stage(stats)
            sel_sq = self.dev.step(lr, want_sq=auto)
        self.win_len += 1
        self.win_lr += lr
        self.since_select += 1
        if auto:
            assert sel_sq is not None
            ends = self._auto_window_ends(sel_sq)
        else:
            ends = self.win_len >= int(self.cfg.update_interval)
        if ends:
            self._boundary(stats, lr, sync=not self.cfg.overlap_step, reselect=True)

    def _auto_window_ends(self, sel_sq: tuple[torch.Tensor, torch.Tensor]) -> bool:
        full_sq, cols_sq = sel_sq  # the device's gradient parts: whole tensors, selected columns
        grads = [g for g in (s.param.grad for s in self.splits) if g is not None]
        if grads:
            total_split = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()
        else:
            total_split = torch.zeros((), device=cols_sq.device)
        # one host sync per step: the window's end decides what this step does next
        sel_v, unsel_v = torch.stack([full_sq + cols_sq, (total_split - cols_sq).clamp(min=0)]).tolist()
        self.win_sel += sel_v
        self.win_unsel += unsel_v
        mean_sel = self.win_sel / self.win_len
        return self.win_unsel >= mean_sel or self.win_len >= self.cfg.max_update_interval

    def _start(self, stats: StepStats) -> None:
        """First zenflow step: choose the initial selection from the current gradient."""
        for s in self.splits:
            g = s.param.grad
            cols = (
                select_columns(g, s.k)
                if g is not None
                else torch.arange(s.k, device=s.param.device)
            )
            self.dev.add_columns(s.name, s.param, cols, self._master_columns(s, cols, stats))
        self.started = True
        self.since_select = 0
        self.epoch_flag = False

    def _master_columns(self, s: _Split, cols: torch.Tensor, stats: StepStats) -> torch.Tensor | None:
        """fp32 CPU-master values of ``cols`` on the device (for bf16/fp16 params; None for fp32)."""
        if s.param.dtype == torch.float32:
            return None
        vals = s.store.shaped(s.store.master, s.index).index_select(1, cols.cpu())
        stats.bytes_h2d += vals.numel() * vals.element_size()
        return vals.to(s.param.device)

    def _stage(self, stats: StepStats) -> None:
        """Copy the split params' gradients off the device and queue their accumulation."""
        assert self.worker is not None
        slot = self.slot
        prev = self.slot_futs[slot]
        if prev is not None:
            with stats.blocked():
                self.worker.wait(prev)
        transfers = []
        for store in self.stores:
            pairs = []
            for s in self.splits:
                if s.store is not store:
                    continue
                g = s.param.grad
                if g is None:
                    s.staging[slot].zero_()
                else:
                    pairs.append((s.staging[slot], g))
            t = self.ops.d2h(pairs)
            stats.bytes_d2h += t.nbytes
            transfers.append((store, t))
        ui = self.cfg.update_interval
        alpha = 1.0 / ui if isinstance(ui, int) else 1.0

        def accumulate(first: bool = self.win_len == 0, acc_i: int = self._acc_index()) -> None:
            for store, t in transfers:
                t.wait()
                store.accumulate(acc_i, slot, alpha=alpha, first=first)

        self.slot_futs[slot] = self.worker.submit(accumulate, urgent=True)
        self.slot ^= 1

    def _accumulate_on_device(self) -> None:
        ui = self.cfg.update_interval
        alpha = 1.0 / ui if isinstance(ui, int) else 1.0
        first = self.win_len == 0
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
        if first:
            torch._foreach_copy_(accs, grads)  # then scale in fp32 (a multiply would round in the grad's dtype)
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
            self._apply_stash()
            if reselect and self._reselect_due():
                self._reselect(stats)
        self._submit_window(lr, stats, window_sel)
        if sync:
            assert self.worker is not None and self.pending is not None
            with stats.blocked():
                self.worker.wait(self.pending.future)
        self.window += 1
        self.win_len = 0
        self.win_lr = 0.0
        self.win_sel = self.win_unsel = 0.0

    def _collect(self, stats: StepStats) -> None:
        """Wait for the pending CPU result and merge it into the device weights."""
        assert self.worker is not None and self.pending is not None
        pending = self.pending
        with stats.blocked():
            seconds = self.worker.wait(pending.future)
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
                    src = s.store.shaped(s.store.result, s.index)
                    p.copy_(src)
                    stats.bytes_h2d += src.numel() * src.element_size()
                for keep, vals in zip(keeps, saved, strict=True):
                    p.index_copy_(1, keep, vals)
            stats.bytes_h2d += pending.h2d_bytes
            self.merge_done = self.ops.record()
        stats.cpu_optimizer_seconds += float(seconds)
        stats.applied_cpu_update = True
        self.pending = None

    def _apply_stash(self) -> None:
        """CPU master of columns dropped at the previous reselection := their last device values."""
        for name, (cols, vals) in self.stash.items():
            s = self.by_name[name]
            s.store.shaped(s.store.master, s.index).index_copy_(1, cols, vals)
            if s.store.out is not None:
                s.store.shaped(s.store.out, s.index).index_copy_(1, cols, vals.to(s.store.dtype))
        self.stash = {}

    def _reselect_due(self) -> bool:
        si = self.cfg.select_interval
        if si == "auto":
            if self.epoch_seen:
                return self.epoch_flag
            return self.since_select >= self.cfg.select_interval_fallback
        return self.since_select >= int(si)

    def _reselect(self, stats: StepStats) -> None:
        for s in self.splits:
            g = s.param.grad
            if g is None:
                continue
            new = select_columns(g, s.k)
            old = self.dev.columns(s.name)
            assert old is not None
            if torch.equal(new, old):
                continue
            values = self._master_columns(s, new, stats)
            dropped, dropped_fp32 = self.dev.reselect(s.name, new, values)
            if dropped.numel():
                stats.bytes_d2h += dropped_fp32.numel() * dropped_fp32.element_size()
                self.stash[s.name] = (dropped.cpu(), dropped_fp32.cpu())
        self.since_select = 0
        self.epoch_flag = False

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
        # scale_cpu_lr: the window's steps' learning rates summed (= lr * n at a constant lr), so the
        # unselected weights travel as far as the device's per-step updates would have, also while the
        # schedule warms up or decays inside the window (lr * n at the boundary overshoots in warm-up).
        win_lr = self.win_lr if self.win_lr == self.win_lr else lr * n  # NaN: restored from an old state
        cpu_lr = win_lr if cfg.scale_cpu_lr else lr
        by_store = {id(st): {s.index: s for s in self.splits if s.store is st} for st in self.stores}
        after = self.merge_done
        ops = self.ops
        h2d_bytes = sum(s.param.numel() * s.param.element_size() for s in self.splits) if ops.is_cuda else 0
        acc_copies = []
        if self.on_device:  # the window's gradient leaves the device once, now
            for store in self.stores:
                pairs = [(store.flat(store.acc[acc_i], s.index), s.dacc) for s in self.splits if s.store is store]
                t_acc = ops.d2h(cast("list[tuple[torch.Tensor, torch.Tensor]]", pairs))  # on_device: dacc set
                stats.bytes_d2h += t_acc.nbytes
                acc_copies.append(t_acc)
                self.dacc_free = t_acc.event

        def run() -> Any:
            busy = 0.0
            last = None
            first_copy = True
            for t_acc in acc_copies:
                t_acc.wait()
            t = time.perf_counter()
            for store in self.stores:
                acc = store.acc[acc_i]
                if scale is not None:
                    acc.mul_(scale)
                for i in store.adam(
                    acc,
                    lr=cpu_lr,
                    betas=cfg.betas,
                    eps=cfg.eps,
                    weight_decay=cfg.weight_decay,
                    num_threads=self.threads,
                    chunk=cfg.cpu_chunk_elements,
                ):
                    if i >= 0 and ops.is_cuda:
                        s = by_store[id(store)][i]
                        assert s.landing is not None
                        last = ops.h2d(
                            [(s.landing, store.flat(store.result, i))], after=after if first_copy else None
                        )
                        first_copy = False
                    busy += time.perf_counter() - t
                    yield
                    t = time.perf_counter()
            busy += time.perf_counter() - t
            if last is not None:
                last.wait()
            return busy

        self.pending = _Pending(self.worker.submit(run), sel, h2d_bytes)

    # --- warm-up --------------------------------------------------------------------------------
    def _synchronous_update(self, stats: StepStats, lr: float) -> None:
        """Offload-style synchronous CPU update of the split params (warm-up rounds)."""
        if not self.splits:
            return
        assert self.worker is not None
        cfg = self.cfg
        with stats.blocked():
            for store in self.stores:
                members = [s for s in self.splits if s.store is store and s.param.grad is not None]
                staging = store.staging[0]
                pairs = [(store.flat(staging, s.index), s.param.grad) for s in members]
                t = self.ops.d2h(cast("list[tuple[torch.Tensor, torch.Tensor]]", pairs))  # grads of `members`
                stats.bytes_d2h += t.nbytes
                only = [s.index for s in members]

                def run(store: HostStore = store, t: Any = t, only: list[int] = only) -> float:
                    t.wait()
                    return store.adam_now(store.staging[0], config=cfg, lr=lr, num_threads=self.threads,
                                          only=only)

                stats.cpu_optimizer_seconds += float(self.worker.wait(self.worker.submit(run)))
                h = self.ops.h2d([(s.param.data, store.flat(store.result, s.index)) for s in members])
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
            self._apply_stash()

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
            res = s.store.shaped(s.store.result, s.index)
            out[s.name][:, cols] = res.index_select(1, cols).to(out[s.name].dtype)
        return out

    # --- sizes ----------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        return self.dev.state_bytes()

    def buffer_bytes(self) -> int:
        total = 0
        for s in self.splits:
            for t in (s.landing, s.dacc):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

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
                "seconds": float(self.pending.future.result()),
            }
        return {
            "mode": self.name,
            "device_params": self.device_params_state(),
            "device_optimizer": self.dev.state_dict(),
            "host": [st.state_dict(acc_index) for st in self.stores],
            "pending": pending,
            "stash": {n: (c.clone(), v.clone()) for n, (c, v) in self.stash.items()},
            "device_acc": {
                s.name: s.dacc.to("cpu", copy=True) for s in self.splits if s.dacc is not None and self.win_len > 0
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

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._drain()
        self.load_device_params(sd["device_params"])
        sched = sd["schedule"]
        self.dev = self._new_device_optimizer()
        dev_sd = sd["device_optimizer"]
        if sched["started"]:
            for s in self.splits:
                self.dev.add_columns(s.name, s.param, torch.as_tensor(dev_sd[s.name]["cols"]))
        self.dev.load_state_dict(dev_sd)
        for st, hs in zip(self.stores, sd["host"], strict=True):
            st.load_state_dict(hs)
        self.win_lr = float("nan")  # states saved before win_lr existed: lr * win_len at the boundary
        for key, value in sched.items():
            setattr(self, key, value)
        self.stash = {n: (torch.as_tensor(c), torch.as_tensor(v)) for n, (c, v) in sd["stash"].items()}
        for name, t in sd.get("device_acc", {}).items():
            dacc = self.by_name[name].dacc
            assert dacc is not None
            dacc.copy_(t)
        self.slot, self.slot_futs, self.merge_done, self.dacc_free = 0, [None, None], None, None
        self.pending = None
        p = sd["pending"]
        if p is not None:
            fut: Future[Any] = Future()
            fut.set_result(float(p["seconds"]))
            sel = {n: torch.as_tensor(c).to(self.ops.device) for n, c in p["sel"].items()}
            h2d_bytes = 0
            if self.ops.is_cuda:  # re-issue the prefetch the saved run had already made
                pairs = [(s.landing, s.store.flat(s.store.result, s.index)) for s in self.splits]
                t = self.ops.h2d(cast("list[tuple[torch.Tensor, torch.Tensor]]", pairs))  # CUDA: landing set
                t.wait()
                h2d_bytes = t.nbytes
            self.pending = _Pending(fut, sel, h2d_bytes)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.ops.release()

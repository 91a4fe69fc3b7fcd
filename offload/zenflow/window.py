"""zenflow's CPU AdamW step of a window, and how its result gets back into the model.

:meth:`WindowUpdate.submit` queues the CPU step on the window's accumulated gradient on the CPU
thread: one AdamW step per host store, at the given learning rate, in ``cpu_chunk_elements`` slices
(so waiting gradient copies run in between); it writes the new bf16/fp16 parameters over the
accumulator it read (fp32: the master is the result). On CUDA the thread then prefetches the finished
params' results into the device landing buffers (H2D stream, after the last merge), so the merge is a
device-to-device copy; in a process group every rank's updated shard is all-gathered into the replica
the landing buffers view (by the CPU thread on its own group over gloo; by the training thread over
NCCL, whose collectives must keep one order on every rank: at the merge, or earlier when
:meth:`WindowUpdate.gather_pending` is called collectively, by ``state_dict()`` or ``consolidated()``,
so that a checkpoint or an export includes the last window).

:meth:`WindowUpdate.collect` waits for that result (the only possible stall) and merges it into the
device weights, except the columns selected when it was submitted or now, where the device's values
win. Warm-up rounds update the split weights synchronously on the CPU instead
(:meth:`WindowUpdate.synchronous`, offload style).
"""

from __future__ import annotations

import time
from collections.abc import Generator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, cast

import torch

from offload.collectives import EngineGroup
from offload.config import EngineConfig
from offload.cpu_thread import CPUThread, gil_released
from offload.device import DeviceOps, Transfer
from offload.host import HostStore
from offload.selection import union
from offload.timing import StepStats
from offload.zenflow.layout import Columns, HostLayout


@dataclass(slots=True)
class Pending:
    #: resolves to (CPU seconds, bytes all-gathered into this rank's replica)
    future: Future[Any]
    #: The selection of the window this result was computed for (its columns are void in the result).
    sel: dict[str, torch.Tensor]
    h2d_bytes: int
    #: The host buffer the CPU step read its gradient from and wrote its bf16/fp16 result into.
    acc_index: int
    #: The result is in the replica (its all-gather has run; a gather on the worker counts once it resolved).
    gathered: bool = False


class WindowUpdate:
    """See the module docstring. ``merge_done``: recorded after the last merge (the next prefetch
    must not overwrite the landing buffers before it)."""

    def __init__(
        self,
        layout: HostLayout,
        ops: DeviceOps,
        ranks: EngineGroup,
        thread: CPUThread | None,
        cfg: EngineConfig,
        *,
        threads: int,
    ) -> None:
        self.layout, self.ops, self.ranks, self.thread, self.cfg = layout, ops, ranks, thread, cfg
        self.threads = threads
        self.merge_done: torch.cuda.Event | None = None

    def submit(
        self,
        acc_i: int,
        lr: float,
        scale: float | None,
        sel: dict[str, torch.Tensor],
        acc_copies: list[Transfer],
    ) -> Pending:
        """Queue the CPU AdamW step on accumulator ``acc_i`` (times ``scale`` first, if given; after
        ``acc_copies`` have landed) and, on CUDA, its prefetch. ``sel``: the selection the window ran
        under (kept by the device at the merge, with the then current one)."""
        assert self.thread is not None
        lay = self.layout
        task = _WindowStep(self, acc_i, lr, scale, acc_copies)
        return Pending(
            self.thread.submit(task.run), sel, task.h2d_bytes, acc_i, gathered=not lay.training_thread_gathers
        )

    def gather_pending(self, pending: Pending) -> int:
        """NCCL: wait for ``pending`` and all-gather its result into the replica on the training thread,
        once (collective: every rank calls it at the same point); the bytes sent (0 when done already)."""
        assert self.thread is not None
        if pending.gathered:
            return 0
        self.thread.wait(pending.future)
        pending.gathered = True
        lay = self.layout
        return sum(lay.all_gather(si, self.ranks.group) for si in range(len(lay.stores)))

    def collect(self, pending: Pending, stats: StepStats, columns: Columns) -> None:
        """Wait for ``pending`` and merge it into the device weights (``columns``: the current selection)."""
        assert self.thread is not None
        lay = self.layout
        with stats.blocked():
            seconds, gathered = self.thread.wait(pending.future)
            # NCCL: on the training thread, in step order. Two threads issuing collectives on two
            # communicators could launch them in different orders on different ranks, and NCCL
            # kernels waiting on each other deadlock; a device all-gather is fast anyway.
            gathered += self.gather_pending(pending)
            lay.replica_ready()
            for s in lay.splits:
                cur = columns(s.name)
                assert cur is not None
                # The device keeps S_{v-1} | S_v. Saving each part on its own instead of their union
                # avoids torch.unique (a host sync on CUDA); columns in both are written twice, alike.
                keeps = [cur] if pending.sel[s.name] is cur else [pending.sel[s.name], cur]
                p = s.param
                saved = [p.index_select(1, keep) for keep in keeps]
                if s.landing is not None:
                    p.copy_(s.landing)
                else:  # CPU, or no landing buffers: from (page-locked) host memory, on the compute stream
                    src = s.store.shaped(s.store.result(pending.acc_index), s.index)
                    p.copy_(src, non_blocking=self.ops.is_cuda)
                    stats.bytes_h2d += src.numel() * src.element_size()
                for keep, vals in zip(keeps, saved, strict=True):
                    p.index_copy_(1, keep, vals)
            stats.bytes_h2d += pending.h2d_bytes
            stats.bytes_gathered += gathered
            self.merge_done = self.ops.record()
        stats.cpu_optimizer_seconds += float(seconds)
        stats.applied_cpu_update = True

    def merged(self, pending: Pending, out: dict[str, torch.Tensor], columns: Columns) -> None:
        """Write into ``out`` (CPU copies of the weights) the columns of ``pending``'s result that a
        merge now would take, without changing anything (waits for the result)."""
        assert self.thread is not None
        self.thread.wait(pending.future)
        self.gather_pending(pending)
        self.layout.replica_ready()
        for s in self.layout.splits:
            cur = columns(s.name)
            assert cur is not None
            keep = union(pending.sel[s.name], cur).cpu()
            take = torch.ones(s.param.shape[1], dtype=torch.bool)
            take[keep] = False
            cols = take.nonzero().squeeze(1)
            if self.layout.gathers:  # the gathered replica (this rank holds only a shard of the result)
                assert s.landing is not None
                res = s.landing.cpu()
            else:
                res = s.store.shaped(s.store.result(pending.acc_index), s.index)
            out[s.name][:, cols] = res.index_select(1, cols).to(out[s.name].dtype)

    # --- warm-up --------------------------------------------------------------------------------
    def synchronous(
        self, stats: StepStats, lr: float, shards: list[torch.Tensor] | None, factor: float | None = None
    ) -> None:
        """Offload-style synchronous CPU update of the split params (warm-up rounds; ``shards``: this
        rank's reduced gradient shard per store, else ``.grad``; ``factor``: the loss-scaled fp16
        gradients' :meth:`~offload.guard.Gate.host_factor`)."""
        lay = self.layout
        if not lay.splits:
            return
        assert self.thread is not None
        thread, cfg = self.thread, self.cfg
        with stats.blocked():
            for si, store in enumerate(lay.stores):
                members = [s for s in lay.members(store) if s.param.grad is not None]
                staging = store.grad_buffer(0)  # no window is open during the warm-up
                if shards is not None:  # this rank's shard of the mean
                    pairs = [(staging, shards[si])]
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
                f = factor if store.dtype == torch.float16 else None

                def run(
                    store: HostStore = store, t: Any = t, only: list[int] = only, f: float | None = f
                ) -> float:
                    with gil_released():
                        t.wait()
                    return store.adam_now(
                        store.grad_buffer(0),
                        config=cfg,
                        lr=lr,
                        num_threads=self.threads,
                        only=only,
                        grad_factor=f,
                    )

                stats.cpu_optimizer_seconds += float(thread.wait(thread.submit(run)))
                if lay.gathers:  # every rank's updated shard into the replica (no window is in flight)
                    stats.bytes_gathered += lay.gather_store(si, 0, self.ranks.group)
                    lay.replica_ready()
                    for s in members:
                        assert s.landing is not None
                        s.param.data.copy_(s.landing)
                    continue
                h = self.ops.h2d([(s.param.data, store.flat(store.result(0), s.index)) for s in members])
                h.wait()
                stats.bytes_h2d += h.nbytes
        stats.applied_cpu_update = True

    # --- persistence ----------------------------------------------------------------------------
    @staticmethod
    def pending_state(pending: Pending | None) -> dict[str, Any] | None:
        """What a state dict keeps of the result in flight (waits for it)."""
        if pending is None:
            return None
        return {
            "sel": {n: c.cpu().clone() for n, c in pending.sel.items()},
            "seconds": float(pending.future.result()[0]),
        }

    def restore(self, p: dict[str, Any], acc_index: int) -> Pending:
        """The result in flight of a loaded state, its CPU step already done into accumulator
        ``acc_index``: restored there and on its way to the device again."""
        lay = self.layout
        fut: Future[Any] = Future()
        fut.set_result((float(p["seconds"]), 0))
        sel = {n: torch.as_tensor(c).to(self.ops.device) for n, c in p["sel"].items()}
        h2d_bytes = 0
        for store in lay.stores:
            store.restore_result(acc_index)
        if lay.gathers:  # every rank's shard of the result into the replica again
            lay.gather_results(acc_index, group=self.ranks.group)
            lay.replica_ready()
        elif lay.splits and all(s.landing is not None for s in lay.splits):  # re-issue the saved prefetch
            pairs = [(s.landing, s.store.flat(s.store.result(acc_index), s.index)) for s in lay.splits]
            t = self.ops.h2d(cast("list[tuple[torch.Tensor, torch.Tensor]]", pairs))  # CUDA: landing set
            t.wait()
            h2d_bytes = t.nbytes
        return Pending(fut, sel, h2d_bytes, acc_index, gathered=True)


class _WindowStep:
    """One window's CPU step, a task of the CPU thread (:meth:`WindowUpdate.submit`): :meth:`run` is a
    generator that yields between AdamW chunks and returns (busy seconds, bytes all-gathered)."""

    def __init__(
        self, update: WindowUpdate, acc_i: int, lr: float, scale: float | None, acc_copies: list[Transfer]
    ) -> None:
        lay = update.layout
        self.update, self.lay, self.acc_i, self.lr, self.scale = update, lay, acc_i, lr, scale
        self.acc_copies = acc_copies
        self.by_store = {id(st): {s.index: s for s in lay.members(st)} for st in lay.stores}
        self.after = update.merge_done
        self.prefetch = (
            update.ops.is_cuda and not lay.gathers and all(s.landing is not None for s in lay.splits)
        )
        self.h2d_bytes = (
            sum(s.param.numel() * s.param.element_size() for s in lay.splits) if self.prefetch else 0
        )
        #: the last prefetch copy issued, and whether none has been yet (the first waits for ``after``)
        self.last: Transfer | None = None
        self.first_copy = True

    def run(self) -> Generator[None, None, tuple[float, int]]:
        cfg, lay, acc_i = self.update.cfg, self.lay, self.acc_i
        busy = 0.0
        self._wait_inputs()
        t = time.perf_counter()
        for store in lay.stores:
            acc = store.bufs[acc_i]
            if self.scale is not None:
                acc.mul_(self.scale)
            for done in store.adam(
                acc,
                lr=self.lr,
                betas=cfg.betas,
                eps=cfg.eps,
                weight_decay=cfg.weight_decay,
                num_threads=self.update.threads,
                chunk=cfg.cpu_chunk_elements,
            ):
                if done and self.prefetch:
                    self._prefetch(store, done)
                busy += time.perf_counter() - t
                yield
                t = time.perf_counter()
        busy += time.perf_counter() - t
        return busy, self._publish()

    def _wait_inputs(self) -> None:
        """The accumulator's copies have landed, and the buffers this step writes are free."""
        with gil_released():
            for t_acc in self.acc_copies:
                t_acc.wait()
            if self.after is not None and not self.prefetch and not self.lay.gathers:
                self.after.synchronize()  # the last merge uploaded from the buffers this step writes

    def _prefetch(self, store: HostStore, done: list[int]) -> None:
        """Finished params' results up into their landing buffers, batched."""
        pairs = []
        for i in done:
            landing = self.by_store[id(store)][i].landing
            assert landing is not None
            pairs.append((landing, store.flat(store.result(self.acc_i), i)))
        self.last = self.update.ops.h2d(pairs, after=self.after if self.first_copy else None)
        self.first_copy = False

    def _publish(self) -> int:
        """The result where the merge takes it: the prefetch landed; in a process group every rank's
        shard gathered (gloo, here) or uploaded for the training thread's gather (NCCL). The bytes
        all-gathered here."""
        lay = self.lay
        if self.last is not None:
            with gil_released():
                self.last.wait()
        gathered = 0
        if lay.gathers and not lay.training_thread_gathers:
            gathered = lay.gather_results(self.acc_i)
        elif lay.gathers:  # NCCL: the training thread gathers (gather_pending)
            for si in range(len(lay.stores)):
                lay.upload_shard(si, self.acc_i, after=self.after)
        return gathered

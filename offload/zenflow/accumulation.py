"""zenflow's window accumulation of the split weights' gradients (the part the CPU steps on).

Host accumulation (default): every step the CPU thread adds the split weights' whole gradients into
the window's host accumulator (``bufs[acc_i]`` of each store, in the parameters' dtype, fp32 for fp16
parameters: summed in fp32, rounded once per step; each gradient times ``1/update_interval``, so the
accumulator holds the window *mean*; for "adaptive" the boundary divides the sum by the window length).
Loss-scaled fp16 gradients (:mod:`offload.guard`) are added times ``alpha`` and the step's landed
gradient factor in one fp32 multiply, so nothing underflows on the way. On CUDA the gradients
stream off the device through a two-slot page-locked ring of ``cpu_chunk_elements`` (D2H stream,
after an event recorded once the step's gradients are final); on a CPU device they are read in place.
Up to two steps' gradients are in flight (:meth:`Accumulation.stage` waits for the step before last);
they stay referenced until read, and :meth:`Accumulation.wait_reads` waits for those reads before the
caller zeroes gradients in place.

Device accumulation (``accumulate_on="device"``): the gradients are added into an fp32 accumulator on
the device (fp16 ones times the device gradient factor, in fp32), copied, rounded to the host
accumulator's dtype, into ``bufs[0]`` once, at the boundary (:meth:`Accumulation.to_host`).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from offload.config import EngineConfig
from offload.cpu_thread import CPUThread, gil_released
from offload.device import DeviceOps, Transfer
from offload.guard import Gate, zero_if_bad_
from offload.host import HostStore
from offload.timing import StepStats
from offload.zenflow.layout import HostLayout


@dataclass(slots=True)
class Staged:
    """This step's gradients, for the CPU thread to add into the window's accumulator (host
    accumulation): per store its params' gradients (None: no gradient), final once ``ready`` has passed
    (CUDA)."""

    slot: int
    grads: list[tuple[int, list[torch.Tensor | None]]]  # (store index, gradients)
    ready: torch.cuda.Event | None
    #: process group: the gradients are already this rank's shard pieces (offload.zenflow.reduction)
    pieces: bool = False


class Accumulation:
    """The window accumulators' filling (see the module docstring)."""

    def __init__(
        self,
        layout: HostLayout,
        ops: DeviceOps,
        thread: CPUThread | None,
        cfg: EngineConfig,
        *,
        threads: int,
        on_device: bool,
    ) -> None:
        self.layout, self.ops, self.thread, self.threads = layout, ops, thread, threads
        self.on_device = on_device
        ui = cfg.update_interval
        self.alpha = 1.0 / ui if isinstance(ui, int) else 1.0
        #: per store, host accumulation on CUDA: the two page-locked slots gradients stream through
        self.rings: list[list[torch.Tensor] | None] = []
        for store in layout.stores:
            ring = None
            if not on_device and ops.is_cuda:
                size = max(1, min(store.numel, cfg.cpu_chunk_elements))
                ring = [ops.host.empty(size, store.dtype) for _ in range(2)]
            self.rings.append(ring)
        self.slot = 0
        self.slot_futs: list[Future[Any] | None] = [None, None]
        self.dacc_free: torch.cuda.Event | None = None  # the last device-accumulator copy has been read

    def reset(self) -> None:
        """Nothing in flight (a loaded state)."""
        self.slot, self.slot_futs, self.dacc_free = 0, [None, None], None

    # --- host accumulation ------------------------------------------------------------------------
    def stage(self, stats: StepStats, shards: list[torch.Tensor] | None) -> Staged:
        """Take this step's split gradients for the CPU thread (read after ``ready``; ``shards``: this
        rank's reduced shard per store, else ``.grad``); at most two steps' gradients are in flight,
        so this first waits for the accumulation of the step before last."""
        assert self.thread is not None
        slot = self.slot
        prev = self.slot_futs[slot]
        if prev is not None:
            with stats.blocked():
                self.thread.wait(prev)
            self.slot_futs[slot] = None
        grads: list[tuple[int, list[torch.Tensor | None]]] = []
        stores = self.layout.stores
        if shards is not None:  # this rank's shard of the mean: the part the host needs
            for si, (store, shard) in enumerate(zip(stores, shards, strict=True)):
                grads.append(
                    (si, [shard.narrow(0, o, n) for o, n in zip(store.offsets, store.numels, strict=True)])
                )
                stats.bytes_d2h += shard.numel() * shard.element_size()
            self.slot ^= 1
            return Staged(slot, grads, self.ops.record(), pieces=True)
        for si, store in enumerate(stores):
            gs: list[torch.Tensor | None] = [None] * len(store.numels)
            for s in self.layout.splits:
                if s.store is store and s.param.grad is not None:
                    g = s.param.grad
                    gs[s.index] = g
                    stats.bytes_d2h += g.numel() * g.element_size()
            grads.append((si, gs))
        self.slot ^= 1
        return Staged(slot, grads, self.ops.record())

    def queue(
        self, staged: Staged, ok: bool, *, first: bool, acc_i: int, factor: float | None = None
    ) -> None:
        """Have the CPU thread add the staged gradient into accumulator ``acc_i`` (overwriting it if
        ``first`` of the window); not if the step is skipped (``ok`` false). ``factor``: what the
        loss-scaled fp16 gradients are still to be multiplied by (:meth:`Gate.host_factor`)."""
        assert self.thread is not None
        if not ok:
            return
        grads, ready, pieces = staged.grads, staged.ready, staged.pieces

        def accumulate() -> None:
            try:
                for si, gs in grads:
                    store, ring = self.layout.stores[si], self.rings[si]
                    alpha = self.alpha
                    if factor is not None and store.dtype == torch.float16:
                        alpha *= factor
                    if ring is None:
                        self._in_place(store, gs, acc_i, alpha, first, pieces)
                    else:
                        self._through(store, gs, ring, ready, acc_i, alpha, first, pieces)
            finally:
                grads.clear()  # release the gradients now, not when the thread's next task replaces this one

        self.slot_futs[staged.slot] = self.thread.submit(accumulate, urgent=True)

    def _in_place(
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

    def _through(
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
        if not chunks:  # this rank's shard of the store is empty (more ranks than elements)
            return
        pending = self._issue(store, grads, ring, chunks, 0, ready, as_pieces)
        for c, (lo, hi) in enumerate(chunks):
            nxt = (
                self._issue(store, grads, ring, chunks, c + 1, ready, as_pieces)
                if c + 1 < len(chunks)
                else None
            )
            with gil_released():
                pending.wait()
            slot = ring[c % 2]
            _zero_uncopied(store, grads, slot, lo, hi)
            store.accumulate(acc[lo:hi], slot[: hi - lo], alpha=alpha, first=first, num_threads=self.threads)
            _release_copied(store, grads, lo, hi)
            if nxt is not None:
                pending = nxt

    def _issue(
        self,
        store: HostStore,
        grads: list[torch.Tensor | None],
        ring: list[torch.Tensor],
        chunks: list[tuple[int, int]],
        c: int,
        ready: torch.cuda.Event | None,
        as_pieces: bool,
    ) -> Transfer:
        """Chunk ``c``'s gradients copied into its ring slot (after ``ready``)."""
        lo, hi = chunks[c]
        slot = ring[c % 2]
        pairs = []
        for i, a, b in _chunk_parts(store, lo, hi):
            g = grads[i]
            if g is not None:
                base = store.offsets[i] + a - lo
                pairs.append((slot[base : base + b - a], (g if as_pieces else store.piece(g, i))[a:b]))
        return self.ops.d2h(pairs, ready=ready)

    def wait_reads(self) -> None:
        """The gradients are about to be zeroed in place: let the CPU thread finish reading them."""
        if self.thread is None:
            return
        for i, fut in enumerate(self.slot_futs):
            if fut is not None:
                self.thread.wait(fut)
                self.slot_futs[i] = None

    # --- device accumulation ----------------------------------------------------------------------
    def add_on_device(self, gate: Gate, *, first: bool) -> None:
        """Add this step's gradients into the fp32 device accumulators (``first``: overwrite them; a
        skipped step adds exact zeros)."""
        if first:
            self.ops.compute_wait(self.dacc_free)  # the previous window's copy has left the accumulator
        accs, grads = self._device_pairs(first)
        if not accs:
            return
        zero_if_bad_(grads, gate)  # a skipped step adds exact zeros
        # loss-scaled fp16 gradients: times the device factor as well (0 on a skipped step)
        scaled = [gate.factor_for(g.dtype) is not None for g in grads]
        if first:
            _overwrite_on_device(accs, grads, scaled, gate, self.alpha)
        else:
            _add_on_device(accs, grads, scaled, gate, self.alpha)

    def _device_pairs(self, first: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The device accumulators of the split weights with a gradient, and those gradients (``first``:
        the accumulators of those without one zeroed)."""
        accs: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for s in self.layout.splits:
            assert s.dacc is not None
            g = s.param.grad
            if g is not None:
                accs.append(s.dacc)
                grads.append(g)
            elif first:
                s.dacc.zero_()
        return accs, grads

    def to_host(self, acc_i: int, stats: StepStats) -> list[Transfer]:
        """The window's device-accumulated gradient into host accumulator ``acc_i`` (asynchronous, one
        copy per store, rounded to the accumulator's dtype on the way in transient device memory)."""
        copies = []
        for store in self.layout.stores:
            pairs = [
                (store.flat(store.bufs[acc_i], s.index), store.piece(s.dacc, s.index))
                for s in self.layout.members(store)
                if s.dacc is not None
            ]
            t_acc = self.ops.d2h(pairs)
            stats.bytes_d2h += t_acc.nbytes
            copies.append(t_acc)
            self.dacc_free = t_acc.event
        return copies

    # --- persistence ------------------------------------------------------------------------------
    def device_state(self) -> dict[str, torch.Tensor]:
        """The device accumulators (an open window's)."""
        return {s.name: s.dacc.to("cpu", copy=True) for s in self.layout.splits if s.dacc is not None}

    def load_device_state(self, sd: dict[str, torch.Tensor]) -> None:
        for name, t in sd.items():
            dacc = self.layout.by_name[name].dacc
            assert dacc is not None
            dacc.copy_(t)


def _chunk_parts(store: HostStore, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(param, start, end) in the param's flat index of the parts of the store's chunk ``[lo, hi)``."""
    out = []
    for i, (off, n) in enumerate(zip(store.offsets, store.numels, strict=True)):
        a, b = max(lo, off), min(hi, off + n)
        if a < b:
            out.append((i, a - off, b - off))
    return out


def _zero_uncopied(
    store: HostStore, grads: list[torch.Tensor | None], slot: torch.Tensor, lo: int, hi: int
) -> None:
    """Zeros in the slot where the chunk's params have no gradient (nothing was copied there)."""
    for i, a, b in _chunk_parts(store, lo, hi):
        if grads[i] is None:
            base = store.offsets[i] + a - lo
            slot[base : base + b - a].zero_()


def _release_copied(store: HostStore, grads: list[torch.Tensor | None], lo: int, hi: int) -> None:
    """A gradient wholly copied by chunk ``[lo, hi)``: let the device reuse its memory now, not at the
    end of the task (the next backward allocates its own while this one may still be held)."""
    for i, _, _ in _chunk_parts(store, lo, hi):
        if store.offsets[i] + store.numels[i] <= hi:
            grads[i] = None


def _overwrite_on_device(
    accs: list[torch.Tensor], grads: list[torch.Tensor], scaled: list[bool], gate: Gate, alpha: float
) -> None:
    """A window's first step: the accumulators become ``alpha`` times the gradients (the loss-scaled
    ones times the device factor as well)."""
    torch._foreach_copy_(accs, grads)  # then scale in fp32 (a multiply would round in the grad's dtype)
    plain = [a for a, sc in zip(accs, scaled, strict=True) if not sc]
    if alpha != 1.0 and plain:
        torch._foreach_mul_(plain, alpha)
    if any(scaled):
        assert gate.grad_factor is not None
        fa = gate.grad_factor * alpha
        torch._foreach_mul_([a for a, sc in zip(accs, scaled, strict=True) if sc], fa)


def _add_on_device(
    accs: list[torch.Tensor], grads: list[torch.Tensor], scaled: list[bool], gate: Gate, alpha: float
) -> None:
    """A later step: ``alpha`` times the gradients added (the loss-scaled ones in fp32, times the
    device factor as well)."""
    if not any(scaled):
        torch._foreach_add_(accs, grads, alpha=alpha)
        return
    assert gate.grad_factor is not None
    fa = gate.grad_factor * alpha
    pairs = [(a, g) for a, g, sc in zip(accs, grads, scaled, strict=True) if not sc]
    if pairs:
        torch._foreach_add_([a for a, _ in pairs], [g for _, g in pairs], alpha=alpha)
    for a, g, sc in zip(accs, grads, scaled, strict=True):
        if sc:
            a.addcmul_(g, fa)  # computed in fp32 (the accumulator's dtype)

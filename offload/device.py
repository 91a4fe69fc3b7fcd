"""Transfers between the device and host memory: CUDA streams and events, or plain copies on CPU.

On CUDA: host buffers are page-locked (``cudaHostRegister`` on an ordinary allocation, so a 4.4 GB
buffer costs 4.4 GB rather than the 8 GB of the caching host allocator's power-of-two blocks; it
falls back to ``pin_memory()``); device-to-host copies run on their own stream after an event
recorded on the compute stream, host-to-device copies on another; each transfer ends with an event
that the consumer waits on (``Transfer.wait()`` on the host, ``DeviceOps.compute_wait()`` on the
compute stream). Source tensors read by a side stream are ``record_stream``-ed, so the caching
allocator cannot hand their memory out again (``zero_grad(set_to_none=True)``) before the copy ends.

On CPU ("the device is the CPU") the same calls copy synchronously and events are ``None``.

Host reads. The engine never reads a device tensor's value on the training thread in a plain step:
device scalars it needs (the gradient norm, whether the step is finite, "adaptive" window masses) go
through :meth:`DeviceOps.read_later` (one stacked non-blocking copy into page-locked memory, queued
before the step's optimizer kernels) and are read with :meth:`Landing.values` once the step's work is
queued. A plain step does not synchronize the device first, so on CUDA that read may still wait for
the backward pass and clipping to finish (counted in ``DeviceOps.host_waits``), but never drains the
device: the step's optimizer kernels are already queued behind the copy. The deliberate blocking reads (one per reselection at most) go through
:meth:`DeviceOps.to_host` and are counted in ``DeviceOps.host_syncs``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)


class Transfer:
    """A copy in flight; ``wait()`` blocks the calling thread until its bytes have landed."""

    __slots__ = ("event", "nbytes")

    def __init__(self, event: torch.cuda.Event | None, nbytes: int) -> None:
        self.event = event
        self.nbytes = nbytes

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())


class Landing:
    """Device scalars on their way to host memory (:meth:`DeviceOps.read_later`).

    ``values()`` reads them; if the copy has not landed yet it waits for it (and the wait is counted
    in ``DeviceOps.host_waits``), otherwise it is a plain read of host memory.
    """

    __slots__ = ("_event", "_host", "_ops", "_values")

    def __init__(self, ops: DeviceOps, host: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self._ops = ops
        self._host = host
        self._event = event
        self._values: list[float] | None = None

    def landed(self) -> bool:
        return self._values is not None or self._event is None or bool(self._event.query())

    def values(self) -> list[float]:
        if self._values is None:
            if not self.landed():
                assert self._event is not None
                self._ops.host_waits += 1
                self._event.synchronize()
            # tolist() reads the host buffer directly (no ATen op: nothing to count or wait for)
            self._values = [float(x) for x in self._host.tolist()]
        return self._values


_PAGE = 4096


def _clear_cuda_error() -> None:
    """Consume the CUDA runtime's pending error after a failed call made through ``torch.cuda.cudart()``.

    torch's cudart binding returns the failure code but leaves the per-thread "last error" set, and the
    next kernel launch check would raise it from an unrelated kernel. The binding has no
    cudaGetLastError, so call it in torch's own libcudart (found in this process's mappings); failing
    that, let one launch check read and clear it.
    """
    import ctypes

    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            lib = next((line.split()[-1] for line in maps if "libcudart" in line), None)
        if lib:
            ctypes.CDLL(lib).cudaGetLastError()
            return
    except (OSError, AttributeError):
        pass
    with contextlib.suppress(RuntimeError):
        torch.empty(1, device="cuda").zero_()


class HostAllocator:
    """Host buffers for one engine; page-locked on CUDA, released explicitly by ``release()``."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        #: False once cudaHostRegister has failed here (then every buffer takes pin_memory()).
        self.register = pin
        self._registered: list[tuple[torch.Tensor, int]] = []
        self._lock = threading.Lock()
        #: Storage addresses of every buffer handed out (see :meth:`owns`).
        self._storages: set[int] = set()

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (or the buffer it views) is host memory from this allocator.

        On a CPU-only run host and "device" memory are both CPU memory; benchmarks use this to tell
        a read of a landed host copy (free) from a read of a device tensor (a host sync on a GPU).
        """
        return t.device.type == "cpu" and t.untyped_storage().data_ptr() in self._storages

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        with self._lock:
            self._storages.add(t.untyped_storage().data_ptr())
        return t

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self._keep(self._empty(numel, dtype))

    def _empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if not self.pin or numel == 0:
            return torch.empty(numel, dtype=dtype)
        if not self.register:
            return torch.empty(numel, dtype=dtype).pin_memory()
        esize = torch.empty((), dtype=dtype).element_size()
        nbytes = numel * esize
        # Page-aligned start and length inside a slightly larger ordinary allocation. Touched first by
        # torch's multi-threaded fill, so registration (which faults pages in on one thread) only pins.
        raw = torch.empty(nbytes + 2 * _PAGE, dtype=torch.uint8).zero_()
        off = (-raw.data_ptr()) % _PAGE
        span = -(-nbytes // _PAGE) * _PAGE
        ptr = raw.data_ptr() + off
        try:
            ok = int(torch.cuda.cudart().cudaHostRegister(ptr, span, 0)) == 0
        except Exception:
            ok = False
        if not ok:
            _clear_cuda_error()
            self.register = False
            log.warning("cudaHostRegister failed; page-locked buffers come from pin_memory() instead")
            return torch.empty(numel, dtype=dtype).pin_memory()
        with self._lock:
            self._registered.append((raw, ptr))
        return raw.narrow(0, off, nbytes).view(dtype)

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.empty(numel, dtype).zero_()

    def scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A transient host buffer in ordinary (pageable) memory, recognised by :meth:`owns` while it
        lives: for rare copies (a reselection's columns) not worth page-locked memory held for good."""
        t = torch.empty(numel, dtype=dtype)
        ptr = t.untyped_storage().data_ptr()
        self._keep(t)
        weakref.finalize(t.untyped_storage(), self._forget, ptr)
        return t

    def _forget(self, ptr: int) -> None:
        with self._lock:
            self._storages.discard(ptr)

    def release(self) -> None:
        """Unregister every page-locked buffer (call after all copies that touch them have ended)."""
        with self._lock:
            regs, self._registered = self._registered, []
            self._storages.clear()
        for _t, ptr in regs:
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(ptr)


def _shaped_like(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, src_first: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(dsts, srcs)`` of ``pairs`` with the host side viewed in the device side's shape.

    ``src_first``: the host tensor is the source (an upload); otherwise it is the destination.
    One ``torch._foreach_copy_`` then covers every pair.
    """
    dsts, srcs = [], []
    for dst, src in pairs:
        if src_first:
            src = src if src.shape == dst.shape else src.view(dst.shape)
        else:
            dst = dst if dst.shape == src.shape else dst.view(src.shape)
        dsts.append(dst)
        srcs.append(src)
    return dsts, srcs


class DeviceOps:
    """Device-type specific plumbing used by the engine's modes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.host = HostAllocator(pin=self.is_cuda)
        if self.is_cuda:
            self.d2h_stream = torch.cuda.Stream(device=device)
            self.h2d_stream = torch.cuda.Stream(device=device)
        self._last_d2h: torch.cuda.Event | None = None
        # page-locked landing slots of read_later, a small ring per length (each read within its step)
        self._slots: dict[int, list[torch.Tensor]] = {}
        self._slot_next: dict[int, int] = {}
        #: Reads of landed scalars that had to wait for the copy (Landing.values on an unfinished copy).
        self.host_waits = 0
        #: Deliberate blocking device-to-host reads (to_host): reselection's one read of new columns.
        self.host_syncs = 0

    # --- compute stream -------------------------------------------------------------------------
    def compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def sync_compute(self) -> None:
        """Block until the work queued on the compute stream has run (``flush()``; never in a plain
        step, where it would drain the device)."""
        if self.is_cuda:
            self.compute_stream().synchronize()

    def timing_event(self) -> torch.cuda.Event | None:
        """A timing event recorded on the compute stream now (None on CPU): stall accounting
        (:class:`offload.timing.IdleClock`)."""
        if not self.is_cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self.compute_stream())
        return ev

    def record(self) -> torch.cuda.Event | None:
        """An event on the compute stream (None on CPU)."""
        if not self.is_cuda:
            return None
        return self._record_cuda()

    def _record_cuda(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(self.compute_stream())
        return ev

    def compute_wait(self, event: torch.cuda.Event | None) -> None:
        """Make the compute stream wait for ``event`` (no host blocking)."""
        if self.is_cuda and event is not None:
            self.compute_stream().wait_event(event)

    def wait_last_d2h(self) -> None:
        """Order the compute stream after the last gradient copy (before grads are zeroed in place)."""
        self.compute_wait(self._last_d2h)

    # --- copies ---------------------------------------------------------------------------------
    def d2h(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], ready: torch.cuda.Event | None = None
    ) -> Transfer:
        """Copy each device ``src`` into its host ``dst`` (same numel; dst flat or of src's shape; a
        ``dst`` of another dtype gets the values converted on the device first: the transfer's
        ``nbytes`` are ``dst``'s).

        On CUDA the copy starts after the work queued on the calling thread's compute stream, or, given
        ``ready`` (from :meth:`record` on the training thread), after that event: how another thread
        copies data the training thread has produced."""
        nbytes = sum(dst.numel() * dst.element_size() for dst, _ in pairs)
        dsts, srcs = _shaped_like(pairs, src_first=False)
        if not self.is_cuda:
            if dsts:
                torch._foreach_copy_(dsts, srcs)
            return Transfer(None, nbytes)
        if ready is None:
            ready = self._record_cuda()
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(ready)
            if dsts:
                torch._foreach_copy_(dsts, srcs, non_blocking=True)
            for src in srcs:
                src.record_stream(self.d2h_stream)
            done = torch.cuda.Event()
            done.record(self.d2h_stream)
        self._last_d2h = done
        return Transfer(done, nbytes)

    def h2d(
        self,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        after: torch.cuda.Event | None = None,
    ) -> Transfer:
        """Copy each host ``src`` (flat, or of dst's shape) into its device ``dst``; on CUDA after ``after``."""
        nbytes = sum(src.numel() * src.element_size() for _, src in pairs)
        dsts, srcs = _shaped_like(pairs, src_first=True)
        if not self.is_cuda:
            if dsts:
                torch._foreach_copy_(dsts, srcs)
            return Transfer(None, nbytes)
        with torch.cuda.stream(self.h2d_stream):
            if after is not None:
                self.h2d_stream.wait_event(after)
            if dsts:
                torch._foreach_copy_(dsts, srcs, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.h2d_stream)
        return Transfer(done, nbytes)

    def read_later(self, scalars: Sequence[torch.Tensor]) -> Landing:
        """Start copying 0-dim device tensors to host memory; read them later with ``values()``.

        One stacked fp32 copy, queued on the compute stream behind the work queued so far (on CUDA
        into a reused page-locked slot, non-blocking), so reading it after more work has been queued
        costs no wait. Slots are reused in a ring of 4 per length: read a landing before making 4
        more of the same length.
        """
        vec = torch.stack([t.reshape(()).to(torch.float32) for t in scalars])
        n = vec.numel()
        ring = self._slots.get(n)
        if ring is None:
            ring = self._slots[n] = [self.host.empty(n, torch.float32) for _ in range(4)]
        i = self._slot_next.get(n, 0)
        self._slot_next[n] = (i + 1) % 4
        host = ring[i]
        if not self.is_cuda:
            host.copy_(vec)
            return Landing(self, host, None)
        host.copy_(vec, non_blocking=True)
        return Landing(self, host, self._record_cuda())

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of device tensor ``t``, waited for: a deliberate host sync (counted)."""
        self.host_syncs += 1
        if not self.is_cuda:
            return t.detach().clone()
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        self._record_cuda().synchronize()
        return out

    def upload(self, host: torch.Tensor) -> tuple[torch.Tensor, Transfer]:
        """A device copy of (page-locked) host tensor ``host`` that compute-stream work may use at once.

        On CUDA the copy runs on the H2D stream and the compute stream waits for it (no host wait);
        ``host`` must not be written again before the returned transfer is done.
        """
        if not self.is_cuda:
            return host.clone(), Transfer(None, host.numel() * host.element_size())
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        t = self.h2d([(out, host)])
        self.compute_wait(t.event)
        return out, t

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def release(self) -> None:
        self.synchronize()
        self.host.release()

"""Transfers between the device and host memory: CUDA streams and events, or plain copies on CPU.

On CUDA: host buffers are page-locked (``cudaHostRegister`` on an ordinary allocation, so a 4.4 GB
buffer costs 4.4 GB rather than the 8 GB of the caching host allocator's power-of-two blocks; it
falls back to ``pin_memory()``); device-to-host copies run on their own stream after an event
recorded on the compute stream, host-to-device copies on another; each transfer ends with an event
that the consumer waits on (``Transfer.wait()`` on the host, ``DeviceOps.compute_wait()`` on the
compute stream). Source tensors read by a side stream are ``record_stream``-ed, so the caching
allocator cannot hand their memory out again (``zero_grad(set_to_none=True)``) before the copy ends.

On CPU ("the device is the CPU") the same calls copy synchronously and events are ``None``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence

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

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
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

    def release(self) -> None:
        """Unregister every page-locked buffer (call after all copies that touch them have ended)."""
        with self._lock:
            regs, self._registered = self._registered, []
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
        self._scalar: torch.Tensor | None = None  # page-locked landing spot of scalar_later (CUDA)

    # --- compute stream -------------------------------------------------------------------------
    def compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def sync_compute(self) -> None:
        """Block until the work queued on the compute stream (the backward pass) has run."""
        if self.is_cuda:
            self.compute_stream().synchronize()

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
    def d2h(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Transfer:
        """Copy each device ``src`` into its host ``dst`` (same numel; dst flat or of src's shape)."""
        nbytes = sum(src.numel() * src.element_size() for _, src in pairs)
        dsts, srcs = _shaped_like(pairs, src_first=False)
        if not self.is_cuda:
            if dsts:
                torch._foreach_copy_(dsts, srcs)
            return Transfer(None, nbytes)
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

    def scalar_later(self, t: torch.Tensor) -> Callable[[], float]:
        """Start copying the 0-dim ``t`` to the host; the returned call waits for it and reads it.

        On CUDA the copy goes into one reused page-locked scalar behind the compute stream's queued
        work, so reading it later waits only for the work queued before this call.
        """
        if not self.is_cuda:
            return lambda: float(t)
        if self._scalar is None or self._scalar.dtype != t.dtype:
            self._scalar = torch.empty((), dtype=t.dtype, pin_memory=True)
        host = self._scalar
        host.copy_(t, non_blocking=True)
        ev = self.record()
        assert ev is not None

        def read() -> float:
            ev.synchronize()
            return float(host)

        return read

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A small synchronous upload (selection bookkeeping)."""
        return t.to(self.device)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def release(self) -> None:
        self.synchronize()
        self.host.release()

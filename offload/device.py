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
import threading
from collections.abc import Sequence

import torch


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


class HostAllocator:
    """Host buffers for one engine; page-locked on CUDA, released explicitly by ``release()``."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._registered: list[tuple[torch.Tensor, int]] = []
        self._lock = threading.Lock()

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if not self.pin or numel == 0:
            return torch.empty(numel, dtype=dtype)
        esize = torch.empty((), dtype=dtype).element_size()
        nbytes = numel * esize
        # Page-aligned start and length inside a slightly larger ordinary allocation.
        raw = torch.empty(nbytes + 2 * _PAGE, dtype=torch.uint8)
        off = (-raw.data_ptr()) % _PAGE
        span = -(-nbytes // _PAGE) * _PAGE
        ptr = raw.data_ptr() + off
        try:
            rt = torch.cuda.cudart()
            ok = int(rt.cudaHostRegister(ptr, span, 0)) == 0
            if not ok and hasattr(rt, "cudaGetLastError"):
                rt.cudaGetLastError()  # do not leave the failure for the next kernel-launch check
        except Exception:
            ok = False
        if not ok:
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
        """Copy each device ``src`` into its host ``dst`` (same numel; dst is a flat view)."""
        nbytes = sum(src.numel() * src.element_size() for _, src in pairs)
        if not self.is_cuda:
            for dst, src in pairs:
                dst.view(src.shape).copy_(src)
            return Transfer(None, nbytes)
        ready = self.record()
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(ready)
            for dst, src in pairs:
                dst.view(src.shape).copy_(src, non_blocking=True)
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
        """Copy each host ``src`` (flat) into its device ``dst``; on CUDA after ``after`` (an event)."""
        nbytes = sum(src.numel() * src.element_size() for _, src in pairs)
        if not self.is_cuda:
            for dst, src in pairs:
                dst.copy_(src.view(dst.shape))
            return Transfer(None, nbytes)
        with torch.cuda.stream(self.h2d_stream):
            if after is not None:
                self.h2d_stream.wait_event(after)
            for dst, src in pairs:
                dst.copy_(src.view(dst.shape), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.h2d_stream)
        return Transfer(done, nbytes)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A small synchronous upload (selection bookkeeping)."""
        return t.to(self.device)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def release(self) -> None:
        self.synchronize()
        self.host.release()

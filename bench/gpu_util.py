"""GPU utilization from NVML, sampled in a background thread while a benchmark's timed steps run.

NVML's ``utilization.gpu`` is the percentage of the last sample period (1/6 s to 1 s, set by the
driver) during which one or more kernels ran: a GPU that waits on the host shows it as idle time.
The sampler polls it every ``interval`` seconds and reports the mean and the samples' count; where
NVML is missing (no ``pynvml`` from ``nvidia-ml-py``, no driver, a CPU run) it reports ``None`` and
says why, so a benchmark runs the same everywhere.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
from types import TracebackType
from typing import Any


class UtilSampler:
    """``with UtilSampler(index) as s: ...`` then ``s.mean`` (percent, or None) and ``s.reason``."""

    def __init__(self, index: int | None, interval: float = 0.05) -> None:
        self.index = index
        self.interval = interval
        self.samples: list[float] = []
        self.reason = ""
        self._handle: Any = None
        self._nvml: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _open(self) -> bool:
        if self.index is None:
            self.reason = "not a CUDA run"
            return False
        try:
            import pynvml  # nvidia-ml-py
        except ImportError:
            self.reason = "pynvml (nvidia-ml-py) not installed"
            return False
        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
        except Exception as e:  # NVMLError: no driver, no permission, index out of range
            self.reason = f"NVML unavailable: {e}"
            return False
        self._nvml = pynvml
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.samples.append(float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))
            except Exception as e:
                self.reason = f"NVML read failed: {e}"
                return

    def __enter__(self) -> UtilSampler:
        if self._open():
            self._thread = threading.Thread(target=self._run, name="nvml-util", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Stop sampling (idempotent: a benchmark may also call it from its cleanup)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None

    @property
    def mean(self) -> float | None:
        """Mean utilization in percent over the samples taken (None: none taken, see ``reason``)."""
        if not self.samples:
            if not self.reason:
                self.reason = "no sample taken (the window was shorter than the sampling interval)"
            return None
        return statistics.fmean(self.samples)


def cuda_index(device: Any) -> int | None:
    """The NVML index of a torch CUDA device (None for CPU). NVML counts all GPUs of the host in PCI
    order; CUDA_VISIBLE_DEVICES renumbers torch's, so a listed mask is translated."""
    if getattr(device, "type", None) != "cuda":
        return None
    import os

    idx = device.index or 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        parts = [p.strip() for p in visible.split(",") if p.strip()]
        if idx < len(parts) and parts[idx].isdigit():
            return int(parts[idx])
    return idx

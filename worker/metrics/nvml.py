"""NVML access (nvidia-ml-py), optional and guarded: the GPUs of this host, the index a worker trains
on, and utilization and memory readings. Never initializes CUDA; every failure means "no GPU
readings", never an error."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

log = logging.getLogger(__name__)


class Nvml:
    """Lazily initialized NVML access; every failure means "no GPU readings", never an error."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ok: bool | None = None
        self._mod: Any = None

    def available(self) -> bool:
        with self._lock:
            if self._ok is None:
                try:
                    import pynvml

                    pynvml.nvmlInit()
                    self._mod = pynvml
                    self._ok = pynvml.nvmlDeviceGetCount() > 0
                except Exception as e:  # library missing, no driver, no device
                    log.debug("NVML unavailable: %s", e)
                    self._ok = False
            return self._ok

    def index_of_uuid(self, uuid: str) -> int | None:
        if not self.available():
            return None
        try:
            return int(self._mod.nvmlDeviceGetIndex(self._mod.nvmlDeviceGetHandleByUUID(uuid)))
        except Exception:
            return None

    def uuid(self, index: int) -> str | None:
        if not self.available():
            return None
        try:
            u = self._mod.nvmlDeviceGetUUID(self._mod.nvmlDeviceGetHandleByIndex(index))
            return u.decode() if isinstance(u, bytes) else str(u)
        except Exception:
            return None

    def device_count(self) -> int:
        """NVIDIA GPUs NVML sees in this process (0 without NVML)."""
        if not self.available():
            return 0
        try:
            return int(self._mod.nvmlDeviceGetCount())
        except Exception:
            return 0

    def name_and_memory(self, index: int) -> tuple[str, int] | None:
        """(device name, total memory bytes) of device ``index``."""
        if not self.available():
            return None
        try:
            h = self._mod.nvmlDeviceGetHandleByIndex(index)
            name = self._mod.nvmlDeviceGetName(h)
            return (name.decode() if isinstance(name, bytes) else str(name)), int(
                self._mod.nvmlDeviceGetMemoryInfo(h).total
            )
        except Exception as e:
            log.debug("NVML name/memory of gpu %s failed: %s", index, e)
            return None

    def sample(self, index: int) -> tuple[float, int, int] | None:
        """(utilization ratio 0..1, memory used bytes, memory total bytes) of device ``index``."""
        if not self.available():
            return None
        try:
            h = self._mod.nvmlDeviceGetHandleByIndex(index)
            util = self._mod.nvmlDeviceGetUtilizationRates(h)
            mem = self._mod.nvmlDeviceGetMemoryInfo(h)
            return float(util.gpu) / 100.0, int(mem.used), int(mem.total)
        except Exception as e:
            log.debug("NVML sample of gpu %s failed: %s", index, e)
            return None


NVML = Nvml()


def nvml_index(nvml: Nvml | None = None) -> int | None:
    """Index, in this process's NVML enumeration, of the device this worker trains on (None: no GPU).

    From the first entry of ``CUDA_VISIBLE_DEVICES`` (an index, or a GPU-/MIG- UUID resolved through
    NVML); unset means device 0 when NVML sees a GPU.
    """
    nvml = nvml or NVML
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        first = cvd.split(",")[0].strip()
        if not first or first == "-1":
            return None
        if first.isdigit():
            return int(first)
        return nvml.index_of_uuid(first)
    return 0 if nvml.available() else None


def visible_indices(nvml: Nvml | None = None) -> list[int]:
    """NVML indices of every entry of ``CUDA_VISIBLE_DEVICES`` (a multi-GPU worker's group; entries
    NVML cannot resolve are left out); [] when it is unset or names no GPU."""
    nvml = nvml or NVML
    out: list[int] = []
    for entry in (os.environ.get("CUDA_VISIBLE_DEVICES") or "").split(","):
        entry = entry.strip()
        if not entry or entry == "-1":
            break  # CUDA ignores what follows an invalid entry
        idx = int(entry) if entry.isdigit() else nvml.index_of_uuid(entry)
        if idx is not None:
            out.append(idx)
    return out


def detect_gpu(nvml: Nvml | None = None) -> str:
    """The ``gpu`` label: the physical GPU index, as DCGM exporter labels it, or ``"none"``.

    In a container given one GPU (``NVIDIA_VISIBLE_DEVICES=3``) NVML numbers it 0 but the host, and
    so DCGM, calls it 3: a single index there wins. Otherwise the NVML index of :func:`nvml_index`.
    For an exact join whatever the numbering, ``zenflow_worker_info`` carries ``gpu_uuid`` (DCGM's
    ``UUID``).
    """
    nvd = os.environ.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if nvd.isdigit():
        return nvd
    idx = nvml_index(nvml)
    return str(idx) if idx is not None else "none"


def detect_gpus() -> list[tuple[int, str]]:
    """(index, kind) of each NVIDIA GPU, via NVML (no torch); [] when there is none."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            name = name.decode() if isinstance(name, bytes) else str(name)
            words = [w for w in name.replace("NVIDIA", "").split() if any(c.isdigit() for c in w)]
            out.append((i, words[0] if words else name.split()[-1]))
        return out
    finally:
        pynvml.nvmlShutdown()

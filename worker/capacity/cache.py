"""A CPU-only host's measured capacity kept on disk between starts, so that ``zenflow serve``, ``make run``
and a job process whose worker has not registered yet do not each import torch, load the C++ optimizer
and time it again (seconds on 2 cores, and twice at once when a job starts before its worker's
measurement is in: they share the cores).

Only a capacity without a GPU is kept (a GPU host's worker measures once per start, its GPU and PCIe
link included). The file is ``<ZENFLOW_CAPACITY_CACHE or $XDG_CACHE_HOME/zenflow or
~/.cache/zenflow>/capacity-<key>.json``; the key hashes what the measurement depends on (host name, CPU
model and flags, usable cores, memory, locked-memory limit, the visible devices, the torch version and
where the optimizer's sources are), and a record older than :data:`MAX_AGE_SECONDS` is measured again.
``ZENFLOW_CAPACITY_CACHE=off`` measures every time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

#: The record kept (worker.capacity.measure.WorkerCapacity, passed in: that module uses this one).
Record = TypeVar("Record", bound=BaseModel)

log = logging.getLogger(__name__)

CACHE_ENV = "ZENFLOW_CAPACITY_CACHE"
#: A kept measurement is used for a day (the CPU optimizer's rate drifts with the host's load).
MAX_AGE_SECONDS = 24 * 3600.0


def cache_dir() -> Path | None:
    """Where measurements are kept; None when ``ZENFLOW_CAPACITY_CACHE=off``."""
    chosen = os.environ.get(CACHE_ENV, "").strip()
    if chosen.lower() in ("off", "0", "false", "no"):
        return None
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "zenflow"


def _cpu_line() -> str:
    found: list[str] = []
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")) and line not in found:
                    found.append(line.strip())
                if len(found) >= 2:
                    break
    except OSError:
        pass
    return "|".join(found)


def cache_key() -> str:
    """A hash of what a measurement depends on (see the module docstring)."""
    from trainer.plan.gpus import host_memory_bytes, locked_memory_limit, usable_cores

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    sources = Path(__file__).resolve().parents[2] / "offload"
    parts = [
        platform.node(),
        platform.machine(),
        _cpu_line(),
        str(usable_cores()),
        str(host_memory_bytes()),
        str(locked_memory_limit()),
        os.environ.get("CUDA_VISIBLE_DEVICES", "-"),
        os.environ.get("NVIDIA_VISIBLE_DEVICES", "-"),
        torch_version,
        str(sources),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def cached_capacity(measure: Callable[[], Record], kind: type[Record], *, gpus_seen: int) -> Record:
    """The kept measurement of this host (a ``kind`` record) when there is a fresh one, else
    ``measure()`` (kept when it found no GPU, ``device_type`` "cpu", and NVML saw none: ``gpus_seen``)."""
    folder = cache_dir()
    path = folder / f"capacity-{cache_key()}.json" if folder is not None and gpus_seen == 0 else None
    if path is not None:
        try:
            if time.time() - path.stat().st_mtime < MAX_AGE_SECONDS:
                return kind.model_validate_json(path.read_text())
        except (OSError, ValidationError, ValueError):
            pass
    capacity = measure()
    if path is not None and getattr(capacity, "device_type", None) == "cpu":
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(capacity.model_dump(mode="json")))
            tmp.replace(path)
        except OSError as e:
            log.debug("capacity not kept at %s: %s", path, e)
    return capacity

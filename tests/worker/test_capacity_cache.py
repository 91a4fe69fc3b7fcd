"""A CPU-only host's capacity is measured once and kept (worker.capacity.cache): ``zenflow serve``,
``make run`` and a job started before its worker registered do not each time it again."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.capacity import cache
from worker.capacity.measure import WorkerCapacity


def _measure(calls: list[int], device: str = "cpu") -> WorkerCapacity:
    calls.append(1)
    if device == "cpu":
        return WorkerCapacity(device_type="cpu", host_memory_bytes=2**34, cores=2, cpu_adam_gbps=5.0)
    return WorkerCapacity(device_type="cuda", gpu_memory_bytes=2**36, host_memory_bytes=2**37, cores=8)


def test_kept_between_starts_and_measured_again_when_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    calls: list[int] = []
    first = cache.cached_capacity(lambda: _measure(calls), WorkerCapacity, gpus_seen=0)
    again = cache.cached_capacity(lambda: _measure(calls), WorkerCapacity, gpus_seen=0)
    assert first == again and len(calls) == 1
    (kept,) = tmp_path.glob("capacity-*.json")
    monkeypatch.setattr(
        "worker.capacity.cache.time.time", lambda: kept.stat().st_mtime + cache.MAX_AGE_SECONDS + 1
    )
    cache.cached_capacity(lambda: _measure(calls), WorkerCapacity, gpus_seen=0)
    assert len(calls) == 2


def test_not_kept_with_a_gpu_nor_when_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    calls: list[int] = []
    for _ in range(2):
        cache.cached_capacity(lambda: _measure(calls), WorkerCapacity, gpus_seen=1)  # NVML sees a GPU
        cache.cached_capacity(lambda: _measure(calls, "cuda"), WorkerCapacity, gpus_seen=0)
    assert len(calls) == 4 and not list(tmp_path.glob("capacity-*.json"))
    monkeypatch.setenv(cache.CACHE_ENV, "off")
    assert cache.cache_dir() is None
    cache.cached_capacity(lambda: _measure(calls), WorkerCapacity, gpus_seen=0)
    cache.cached_capacity(lambda: _measure(calls), WorkerCapacity, gpus_seen=0)
    assert len(calls) == 6


def test_a_corrupt_record_is_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    (tmp_path / f"capacity-{cache.cache_key()}.json").write_text("{not json")
    calls: list[int] = []
    got = cache.cached_capacity(lambda: _measure(calls), WorkerCapacity, gpus_seen=0)
    assert got.cpu_adam_gbps == 5.0 and len(calls) == 1

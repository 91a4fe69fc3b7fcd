"""A worker's capacity (measured on this machine), its conversion to the plan's Machine, the default
capacity, and the worker registry with its heartbeat thread, against the real PostgreSQL."""

from __future__ import annotations

import resource
import time
from datetime import timedelta

import pytest
import torch

from store import worker_registry
from store.db import session_scope
from store.orm import Worker, as_utc, utcnow
from store.settings import Settings
from trainer.plan.gpus import KNOWN_GPUS, GiB
from worker.capacity.measure import WorkerCapacity, default_capacity, measure_capacity, to_machine
from worker.capacity.presence import WorkerPresence


def test_capacity_measured_here_is_plausible() -> None:
    cap = measure_capacity(adam_seconds=0.05)
    assert cap.host_memory_bytes > 0 and cap.cores >= 1
    assert cap.cpu_adam_gbps is not None and cap.cpu_adam_gbps > 0
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert cap.locked_memory_bytes == (None if soft == resource.RLIM_INFINITY else soft)
    if torch.cuda.is_available():
        assert (
            cap.device_type == "cuda" and cap.gpu_name and cap.gpu_memory_bytes > 0 and cap.gpus_on_host >= 1
        )
        assert cap.pcie_gbps is not None and cap.pcie_gbps > 0
    else:
        assert cap.device_type == "cpu" and cap.gpu_name is None and cap.pcie_gbps is None
    machine = to_machine(WorkerCapacity.model_validate_json(cap.model_dump_json()))  # as stored and read back
    assert machine.device_type == cap.device_type
    assert machine.host_memory_bytes <= cap.host_memory_bytes and machine.cores >= 1


def test_a_gpu_worker_gets_its_share_of_the_host() -> None:
    cap = WorkerCapacity(
        device_type="cuda",
        gpu_name="NVIDIA H100 80GB HBM3",
        gpu_memory_bytes=80 * GiB,
        gpus_on_host=8,
        host_memory_bytes=2048 * GiB,
        cores=128,
        cpu_adam_gbps=160.0,
        pcie_gbps=52.0,
        locked_memory_bytes=None,
    )
    m = to_machine(cap)
    assert (m.gpu_name, m.gpu_flops, m.gpu_memory_bytes) == ("h100", KNOWN_GPUS["h100"].flops, 80 * GiB)
    assert (m.host_memory_bytes, m.cores, m.cpu_adam_gbps, m.pcie_gbps) == (256 * GiB, 16, 20.0, 52.0)
    unknown = to_machine(
        cap.model_copy(update={"gpu_name": "Some GPU X", "gpu_sm_count": 100, "gpus_on_host": 1})
    )
    assert unknown.gpu_name == "Some GPU X" and unknown.gpu_flops == pytest.approx(100 * 2.9e12)
    assert unknown.host_memory_bytes == 2048 * GiB


def test_default_capacity_describes_a_typical_box() -> None:
    settings = Settings(_env_file=None)
    m = to_machine(default_capacity(settings))
    assert (m.device_type, m.gpu_name, m.gpu_memory_bytes) == (
        "cuda",
        "h100",
        KNOWN_GPUS["h100"].memory_bytes,
    )
    assert (m.host_memory_bytes, m.cores, m.locked_memory_bytes) == (192 * GiB, 24, None)
    cpu = to_machine(default_capacity(settings.model_copy(update={"default_worker_gpu": ""})))
    assert cpu.device_type == "cpu" and cpu.host_memory_bytes == 192 * GiB
    with pytest.raises(ValueError, match="ZENFLOW_DEFAULT_WORKER_GPU_MEMORY_BYTES"):
        default_capacity(settings.model_copy(update={"default_worker_gpu": "mystery-9000"}))


CAP = WorkerCapacity(device_type="cpu", host_memory_bytes=64 * GiB, cores=8, cpu_adam_gbps=20.0)


def test_registry_live_workers_per_queue(pg_db_url: str) -> None:
    t0 = utcnow()
    with session_scope(pg_db_url) as s:
        worker_registry.register(s, "reg-a@test", ["q-reg-1", "q-reg-2"], CAP.model_dump(), now=t0)
        worker_registry.register(
            s, "reg-b@test", ["q-reg-2"], CAP.model_dump(), now=t0 - timedelta(seconds=90)
        )
    try:
        with session_scope(pg_db_url) as s:

            def live(queue: str, at: float) -> list[str]:
                return [
                    w.name
                    for w in worker_registry.live_workers(
                        s, queue, live_seconds=60, now=t0 + timedelta(seconds=at)
                    )
                ]

            assert live("q-reg-1", 0) == ["reg-a@test"] and live("q-reg-2", 0) == ["reg-a@test"]
            assert live("q-reg-1", 61) == [] and live("q-other", 0) == []
            assert worker_registry.heartbeat(s, "reg-b@test", now=t0)
            assert live("q-reg-2", 0) == ["reg-a@test", "reg-b@test"]
            assert not worker_registry.heartbeat(s, "reg-missing@test")
            # a restarted worker replaces its row: new queues and capacity
            worker_registry.register(s, "reg-a@test", ["q-reg-3"], {**CAP.model_dump(), "cores": 4}, now=t0)
            assert live("q-reg-1", 0) == [] and live("q-reg-3", 0) == ["reg-a@test"]
            assert WorkerCapacity.model_validate(worker_registry.get(s, "reg-a@test").capacity).cores == 4  # type: ignore[union-attr]
    finally:
        with session_scope(pg_db_url) as s:
            worker_registry.unregister(s, "reg-a@test")
            worker_registry.unregister(s, "reg-b@test")
            assert s.get(Worker, "reg-a@test") is None


def test_worker_registers_its_measured_capacity_and_keeps_its_heartbeat(pg_db_url: str) -> None:
    """The real path: the capacity measured in ``python -m worker.capacity.measure``, the row written,
    the heartbeat refreshed, the row written again when it vanished, and removed on stop."""
    settings = Settings(_env_file=None, database_url=pg_db_url)
    presence = WorkerPresence("presence@test", ["q-presence"], settings=settings, interval=0.2)
    presence.start()
    try:
        assert presence.registered.wait(120), "the worker did not register"
        assert presence.capacity is not None and presence.capacity.cpu_adam_gbps
        with session_scope(pg_db_url) as s:
            row = s.get(Worker, "presence@test")
            assert row is not None and row.queues == ["q-presence"]
            assert WorkerCapacity.model_validate(row.capacity) == presence.capacity
            first = as_utc(row.heartbeat_at)
        assert first is not None

        def beat() -> object:
            with session_scope(pg_db_url) as s:
                row = s.get(Worker, "presence@test")
                return row and as_utc(row.heartbeat_at)

        deadline = time.monotonic() + 10
        while (b := beat()) is None or b <= first:  # type: ignore[operator]
            assert time.monotonic() < deadline, "the heartbeat was not refreshed"
            time.sleep(0.1)
        with session_scope(pg_db_url) as s:
            worker_registry.unregister(s, "presence@test")
        deadline = time.monotonic() + 10
        while beat() is None:
            assert time.monotonic() < deadline, "the worker did not register again"
            time.sleep(0.1)
    finally:
        presence.stop()
    assert beat() is None and not presence.is_alive()

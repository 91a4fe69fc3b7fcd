"""Issue 22, item 6: bench.engine_ops counts what the training thread waits for: profiler events of
other threads (the CPU optimizer's) are left out, reselection steps are counted like any other, and
a "non-blocking" copy with a pageable host side counts as the blocking copy it is on CUDA."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from bench.sync_count import copy_blocks, profile_counts


@dataclass
class _Range:
    start: float
    end: float


@dataclass
class _Ev:
    name: str
    thread: int
    time_range: _Range


def _ev(name: str, thread: int, start: float, dur: float = 1.0) -> _Ev:
    return _Ev(name, thread, _Range(start, start + dur))


def test_profile_counts_only_the_training_threads_events() -> None:
    train, worker = 11, 22
    events = [
        _ev("zenflow-step-0", train, 0, 1000),
        _ev("cudaLaunchKernel", train, 10),
        _ev("cudaLaunchKernel", train, 20),
        _ev("cudaEventSynchronize", train, 30, 250),  # the training thread waits 0.25 ms
        _ev("cudaLaunchKernel", worker, 40),  # the CPU optimizer thread, overlapping the step
        _ev("cudaStreamSynchronize", worker, 50, 800),
        _ev("cudaMemcpy", worker, 60, 100),
        _ev("zenflow-step-1", train, 2000, 1000),
        _ev("cudaMemcpy", train, 2100, 500),  # a reselection's blocking copy
        _ev("cudaMemcpyAsync", train, 2700),
        _ev("cudaStreamSynchronize", worker, 2200, 400),
        _ev("cudaLaunchKernel", train, 3500),  # after the step's label: not inside
    ]
    out = profile_counts(events, {"zenflow-step-0": "plain", "zenflow-step-1": "reselection"})
    assert out["plain"] == {"launches": 2, "blocking_calls": 1, "blocked_ms": 0.25, "steps": 1}
    assert out["reselection"] == {"launches": 0, "blocking_calls": 1, "blocked_ms": 0.5, "steps": 1}


class _Host:
    """A host tensor stand-in whose page-locking is given (CPU-only torch cannot pin memory)."""

    def __init__(self, pinned: bool) -> None:
        self.device = torch.device("cpu")
        self.pinned = pinned

    def is_pinned(self) -> bool:
        return self.pinned


@pytest.mark.parametrize(
    ("pinned", "non_blocking", "blocks"),
    [(True, True, False), (False, True, True), (True, False, True), (False, False, True)],
)
def test_a_copy_blocks_unless_non_blocking_with_page_locked_host_memory(
    pinned: bool, non_blocking: bool, blocks: bool
) -> None:
    dev = torch.empty(4, device="meta")  # the device side
    host = _Host(pinned)
    assert copy_blocks(host, dev, non_blocking, host.device) is blocks  # device to host
    assert copy_blocks(dev, host, non_blocking, dev.device) is blocks  # type: ignore[arg-type]  # host to device
    assert copy_blocks(None, dev, non_blocking, torch.device("cpu")) is True  # a new pageable tensor
    assert copy_blocks(None, dev, non_blocking, dev.device) is False  # same memory: no transfer

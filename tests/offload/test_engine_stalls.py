"""Issue 22, item 4: no device sync in a plain step, and stall accounting (CUDA: device idle time from
timing events, exercised here with host-clock events; CPU: time step() blocked, as before)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from offload.config import EngineConfig
from offload.engine import ZenFlowEngine
from offload.timing import IdleClock, StepStats


class FakeEvent:
    """A timing event whose device "runs" it at a given host time (default: when it is recorded,
    i.e. a drained device); ``done`` says whether it has run yet."""

    def __init__(self, t: float | None = None, done: bool = True) -> None:
        self.t = time.perf_counter() if t is None else t
        self.done = done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: Any) -> float:
        return float(end.t - self.t) * 1e3


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))


def _spy(real: Any, name: str, calls: list[str]) -> Any:
    def spy() -> None:
        calls.append(name)
        real()

    return spy


def _backward(model: torch.nn.Module, i: int) -> None:
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(8, 16, generator=g)
    model(x).square().mean().backward()


def test_idle_clock_reads_closed_intervals_in_order_and_keeps_the_rest() -> None:
    clock = IdleClock()
    a, b = FakeEvent(0.0), FakeEvent(0.25)
    c, d = FakeEvent(1.0), FakeEvent(1.5, done=False)
    e, f = FakeEvent(2.0), FakeEvent(2.125)  # closed, but behind an open pair: stream order
    clock.add(a, b)
    clock.add(c, d)
    clock.add(e, f)
    assert clock.harvest() == pytest.approx(0.25)
    assert clock.pending == 2 and clock.harvest() == 0.0
    d.done = True
    assert clock.harvest() == pytest.approx(0.5 + 0.125) and clock.pending == 0


def test_blocked_sections_are_bracketed_by_marks_only_when_there_are_events() -> None:
    plain = StepStats()
    with plain.blocked():
        time.sleep(0.01)
    assert plain.stall_seconds >= 0.01 and plain.marks == []
    timed = StepStats(mark=FakeEvent)
    with timed.blocked():
        time.sleep(0.01)
    assert len(timed.marks) == 1
    start, end = timed.marks[0]
    assert start.elapsed_time(end) >= 10.0
    none = StepStats(mark=lambda: None)  # DeviceOps.timing_event on CPU
    with none.blocked():
        pass
    assert none.marks == []


@pytest.mark.parametrize("mode", ["device", "offload", "zenflow"])
def test_a_plain_step_never_synchronizes_the_device(mode: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for name in ("synchronize", "current_stream"):  # what a CUDA run would reach, if anything did
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name, **k: calls.append(_n))
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda self: calls.append("stream"))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: calls.append("event"))
    model = _mlp()
    cfg = EngineConfig(mode=mode, lr=1e-2, topk_ratio=0.25, update_interval=2, select_interval=4)
    with ZenFlowEngine(model, cfg) as eng:
        ops = eng._ops
        for name in ("sync_compute", "synchronize"):
            monkeypatch.setattr(ops, name, _spy(getattr(ops, name), name, calls))
        for i in range(6):
            _backward(model, i)
            eng.step()
            eng.zero_grad()
        assert calls == []
        eng.flush()  # the spy works: flush waits for the device on purpose
        assert calls == ["sync_compute"]


def test_cpu_stall_is_the_time_step_blocked() -> None:
    """CPU-only semantics unchanged: the synchronous offload step's CPU AdamW is stall, the time
    between steps is not."""
    model = _mlp()
    with ZenFlowEngine(model, EngineConfig(mode="offload", lr=1e-2)) as eng:
        _backward(model, 0)
        eng.step()
        eng.zero_grad()
        _backward(model, 1)
        time.sleep(0.05)  # host work outside step(): compute on a CPU-only run
        t0 = time.perf_counter()
        m = eng.step()
        inside = time.perf_counter() - t0
    assert m.wall_seconds >= 0.05 + inside - 1e-3
    assert 0 < m.stall_seconds <= inside
    assert m.compute_seconds == pytest.approx(m.wall_seconds - m.stall_seconds)
    assert m.compute_seconds >= 0.05


def test_device_idle_gap_between_steps_is_stall(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA accounting with events the device runs as soon as they are queued (a drained device):
    the gap from one step's end to the next ``begin_step()`` is stall, the time after it is not."""
    model = _mlp()
    with ZenFlowEngine(model, EngineConfig(mode="device", lr=1e-2)) as eng:
        monkeypatch.setattr(eng._ops, "timing_event", FakeEvent)
        _backward(model, 0)
        t_a = time.perf_counter()
        eng.step()
        eng.zero_grad()
        time.sleep(0.06)  # the device idles: nothing queued
        eng.begin_step()
        t_b = time.perf_counter()
        eng.begin_step()  # idempotent within a step
        time.sleep(0.03)  # the "device" works (forward, backward)
        _backward(model, 1)
        m = eng.step()
        assert 0.06 <= m.stall_seconds <= t_b - t_a
        assert m.compute_seconds >= 0.03
        eng.zero_grad()
        _backward(model, 2)  # no begin_step(): the gap is not measured
        time.sleep(0.02)
        m2 = eng.step()
        assert m2.stall_seconds == 0.0  # device mode blocks nowhere in step()


def test_idle_still_running_on_the_device_counts_in_the_next_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """An interval whose closing event has not run is not waited for: the next step counts it."""
    model = _mlp()
    made: list[FakeEvent] = []

    def event() -> FakeEvent:
        made.append(FakeEvent(done=False))
        return made[-1]

    with ZenFlowEngine(model, EngineConfig(mode="device", lr=1e-2)) as eng:
        monkeypatch.setattr(eng._ops, "timing_event", event)
        _backward(model, 0)
        eng.step()
        time.sleep(0.04)
        eng.begin_step()
        _backward(model, 1)
        m1 = eng.step()  # the gap's closing event is still "queued"
        assert m1.stall_seconds == 0.0 and eng._idle.pending == 1
        idle = made[1].t - made[0].t  # step 1's end event to begin_step(): at least the sleep
        assert idle >= 0.04
        for ev in made:
            ev.done = True
        _backward(model, 2)
        m2 = eng.step()  # counts it, capped at its wall time; the rest carries on
        assert m2.stall_seconds == pytest.approx(min(idle, m2.wall_seconds))
        _backward(model, 3)
        time.sleep(0.05)
        m3 = eng.step()
        assert m3.stall_seconds <= m3.wall_seconds
        assert m2.stall_seconds + m3.stall_seconds + eng._carry == pytest.approx(idle)

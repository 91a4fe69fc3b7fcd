"""What one engine step measured: stall, CPU optimizer time and bytes moved.

The modes fill a :class:`StepStats` while the engine times the whole step; the engine then turns
it into the public :class:`offload.step_metrics.StepMetrics` (``compute = wall - stall``).

Stall has two sources. On a CPU-only run it is the time ``step()`` blocked (``StepStats.blocked``).
On CUDA it is the device's idle time, measured with CUDA events by an :class:`IdleClock`: two timing
events recorded on the compute stream with no device work queued between them run ``elapsed`` apart
exactly when the stream had nothing to do in between (the second runs as soon as it is queued if the
stream has drained, right after the first otherwise). The engine brackets every ``blocked()`` section
and the gap between one step's last queued work and the next step's first with such pairs.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol


class TimingEvent(Protocol):
    """What an :class:`IdleClock` needs of an event (``torch.cuda.Event(enable_timing=True)``)."""

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> Any: ...


class IdleClock:
    """Device idle time from pairs of timing events, read without waiting for the device.

    ``add(start, end)``: an interval with no device work queued between ``start`` and ``end``.
    ``harvest()`` sums the intervals whose ``end`` has run on the device (in the order they were
    added; a pair whose end has not run yet waits for a later harvest), so no read blocks.
    """

    def __init__(self) -> None:
        self._pairs: deque[tuple[TimingEvent, TimingEvent]] = deque()

    def add(self, start: TimingEvent, end: TimingEvent) -> None:
        self._pairs.append((start, end))

    @property
    def pending(self) -> int:
        return len(self._pairs)

    def harvest(self) -> float:
        """Seconds of device idle time in the closed intervals not read before."""
        total = 0.0
        while self._pairs and self._pairs[0][1].query():
            start, end = self._pairs.popleft()
            total += max(0.0, float(start.elapsed_time(end))) / 1e3  # milliseconds
        return total

    def clear(self) -> None:
        self._pairs.clear()


@dataclass(slots=True)
class StepStats:
    stall_seconds: float = 0.0
    cpu_optimizer_seconds: float = 0.0
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    applied_cpu_update: bool = False
    synchronous: bool = False
    #: Bytes this rank fed into gradient reductions and received from all-gathers (process groups).
    bytes_reduced: int = 0
    bytes_gathered: int = 0
    #: CUDA: records a timing event on the compute stream (``DeviceOps.timing_event``); None on CPU.
    mark: Callable[[], TimingEvent | None] | None = None
    #: CUDA: the ``blocked()`` sections as pairs of timing events, for the engine's :class:`IdleClock`.
    marks: list[tuple[TimingEvent, TimingEvent]] = field(default_factory=list)

    @contextmanager
    def blocked(self) -> Iterator[None]:
        """Count the enclosed time as stall (the training thread waits on CPU work or transfers).

        The host time is kept (``stall_seconds``, the stall of a CPU-only run); on CUDA the section is
        also bracketed by timing events, whose distance is the device's idle time in it plus the
        device work the section itself queued (a window's merge, a reselection).
        """
        start = self.mark() if self.mark is not None else None
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stall_seconds += time.perf_counter() - t0
            if start is not None and self.mark is not None:
                end = self.mark()
                if end is not None:
                    self.marks.append((start, end))


class _Begins(Protocol):
    def begin_step(self) -> None: ...


def begin_step_hook(engine: _Begins) -> Callable[[object, object], None]:
    """A forward pre-hook calling ``engine.begin_step()`` that does not keep the engine alive."""
    ref = weakref.ref(engine)

    def hook(_module: object, _args: object) -> None:
        e = ref()
        if e is not None:
            e.begin_step()

    return hook

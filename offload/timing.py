"""What one engine step measured: blocked time, CPU optimizer time and bytes moved.

The modes fill a :class:`StepStats` while the engine times the whole step; the engine then turns
it into the public :class:`offload.metrics.StepMetrics` (``compute = wall - stall``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


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

    @contextmanager
    def blocked(self) -> Iterator[None]:
        """Count the enclosed time as stall (the training thread waits on CPU work or transfers)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stall_seconds += time.perf_counter() - t0

"""Value types every part of the contract uses."""

from __future__ import annotations

from typing import Literal

#: A setting left to the service: :mod:`trainer.resolve` decides it once, and the resolution records the
#: value and where it came from.
Auto = Literal["auto"]

#: The largest step, epoch, batch or length count a job may have: its step counters are 32-bit integer
#: columns in the database.
MAX_COUNT = 2**31 - 1

#: The parameters' dtype of a run: bfloat16 on a GPU (every engine mode keeps fp32 master weights),
#: float32 on a CPU.
Dtype = Literal["float32", "bfloat16"]

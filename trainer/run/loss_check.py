"""After a run: did the training loss move? A run whose loss fell less than :data:`MIN_DROP` taught the
model little (a learning rate too low for the base, most often), and the job's events say so."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from trainer.events import LogEvent

#: A run whose training loss fell less than this fraction of where it started gets the warning.
MIN_DROP = 0.10
#: Where it started: the mean loss of this many first steps of the run.
FIRST_STEPS = 5


def little_learned(first: Sequence[float], final: float | None, *, steps: int, lr: float) -> LogEvent | None:
    """The warning for a run whose mean loss of its last steps (``final``, the run's train_loss) is above
    ``1 - MIN_DROP`` of the mean of its ``first`` steps; None when it fell further, or the run was too
    short to tell (fewer than twice FIRST_STEPS steps)."""
    if final is None or steps < 2 * FIRST_STEPS or len(first) < FIRST_STEPS:
        return None
    start = statistics.fmean(first[:FIRST_STEPS])
    if start <= 0 or final <= start * (1 - MIN_DROP):
        return None
    drop = 1 - final / start
    return LogEvent(
        f"The training loss fell only {max(drop, 0.0):.0%} in {steps} steps (from {start:.3f}, its first "
        f"{FIRST_STEPS} steps' mean, to {final:.3f}): the model learned little. The learning rate "
        f"({lr:.2e}) may be too low for this base: try learning_rate_multiplier 3 to 10, or more epochs",
        level="warning",
        data={"start_loss": start, "final_loss": final, "drop": drop, "steps": steps, "learning_rate": lr},
    )

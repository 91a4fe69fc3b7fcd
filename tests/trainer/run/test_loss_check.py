"""trainer.run.loss_check: a run whose training loss barely fell says so in its events, with the numbers
and what to change; a run that learned, or was too short to tell, says nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.run.test_loop import Recorder, make_spec
from trainer.run.loop import run_training
from trainer.run.loss_check import FIRST_STEPS, MIN_DROP, little_learned


def test_the_warning_needs_a_loss_that_barely_fell_over_enough_steps() -> None:
    first = [2.0] * FIRST_STEPS
    warned = little_learned(first, 2.0 * (1 - MIN_DROP / 2), steps=40, lr=1e-5)
    assert warned is not None and warned.level == "warning"
    assert "fell only 5% in 40 steps" in warned.message and "learning_rate_multiplier" in warned.message
    assert warned.data["drop"] == pytest.approx(MIN_DROP / 2)
    assert little_learned(first, 2.4, steps=40, lr=1e-5) is not None  # it rose: "only 0%"
    assert little_learned(first, 2.0 * (1 - 2 * MIN_DROP), steps=40, lr=1e-5) is None  # it learned
    assert little_learned(first, 2.0, steps=2 * FIRST_STEPS - 1, lr=1e-5) is None  # too short to tell
    assert little_learned(first[:2], 2.0, steps=40, lr=1e-5) is None
    assert little_learned(first, None, steps=40, lr=1e-5) is None


@pytest.mark.usefixtures("torch_single_thread")
def test_a_run_at_a_learning_rate_far_too_low_warns_in_its_events(tmp_path: Path) -> None:
    rec = Recorder()
    hp = {"learning_rate": 1e-9, "n_epochs": 2, "batch_size": 4, "eval_every": None, "checkpoint_every": 100}
    result = run_training(make_spec(tmp_path, valid=None, hyperparameters=hp), on_event=rec)
    warnings = [e for e in rec.of("log") if e.level == "warning" and "learned little" in e.message]
    assert len(warnings) == 1 and result.steps >= 2 * FIRST_STEPS, [e.message for e in rec.of("log")]
    assert warnings[0].data["learning_rate"] == pytest.approx(1e-9)
    assert rec.events.index(warnings[0]) < rec.events.index(rec.of("run_finished")[0])

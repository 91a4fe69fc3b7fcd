"""bench/convergence.py's summary: means over seeds, ratios to the chosen baseline variant, and the
validation-loss ratio seed by seed (how lean host moments are compared with fp32 ones)."""

from __future__ import annotations

import pytest

from bench.convergence import Run, summarize


def test_ratios_to_a_chosen_baseline_per_seed() -> None:
    runs = [
        Run("zenflow", 0, 10, 2.0, 1.0, 1.0),
        Run("zf-bf16", 0, 10, 2.2, 1.01, 1.0),
        Run("zenflow", 1, 10, 2.0, 2.0, 1.0),
        Run("zf-bf16", 1, 10, 1.8, 1.98, 1.0),
    ]
    out = summarize(runs, ["zenflow", "zf-bf16"], baseline="zenflow")
    lean = out["zf-bf16"]
    assert lean["valid_ratio"] == pytest.approx(((1.01 + 1.98) / 2) / 1.5)
    assert lean["valid_ratio_per_seed"] == pytest.approx({0: 1.01, 1: 0.99})
    assert out["zenflow"]["valid_ratio_per_seed"] == {0: 1.0, 1: 1.0}
    assert summarize(runs, ["zenflow"])["zenflow"]["valid_ratio"] is None  # no device run: no ratio

"""The metrics endpoint's rows (api.jobs.views.step_metric_object): a reinforcement step's
``method_metrics`` served as stored; other methods' null."""

from __future__ import annotations

from datetime import UTC, datetime

from api.jobs.views import step_metric_object
from store.orm import JobStepMetric

WHEN = datetime(2026, 12, 7, tzinfo=UTC)


def test_a_reinforcement_steps_rewards_are_served() -> None:
    figures = {"reward_mean": 0.41, "reward_min": 0.0, "reward_max": 1.0, "sub_rewards": {"exact": 0.5}}
    row = JobStepMetric(job_id="ftjob-r", step=3, created_at=WHEN, train_loss=0.0, method_metrics=figures)
    got = step_metric_object(row).model_dump()
    assert got["method_metrics"] == figures and got["step"] == 3


def test_other_steps_have_none() -> None:
    row = JobStepMetric(job_id="ftjob-s", step=1, created_at=WHEN, train_loss=1.0)
    assert step_metric_object(row).model_dump()["method_metrics"] is None

"""The results CSV (store.results): OpenAI's columns and ours; a reinforcement job's reward columns."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from store.orm import Base, JobStepMetric
from store.results import COLUMNS, metrics_csv

FIGURES = {
    "reward_mean": 0.41,
    "reward_min": 0.0,
    "reward_max": 1.0,
    "samples": 16,
    "completion_tokens_mean": 12.5,
    "truncated_fraction": 0.125,
    "grader_errors": 2,
    "grader_error_flags": {"model_grader_parse_error": 2},
    "sub_rewards": {"exact": 0.5},
    "generation_seconds": 1.5,
    "grading_seconds": 0.25,
    "rollout_tokens_per_second": 133.0,
}


@pytest.fixture
def session() -> Iterator[Session]:
    engine = create_engine("sqlite://")  # no foreign keys enforced: metrics rows without their job
    Base.metadata.create_all(engine, tables=[JobStepMetric.__table__])  # type: ignore[list-item]
    with Session(engine) as s:
        yield s
    engine.dispose()


def _rows(s: Session, job_id: str) -> list[dict[str, str]]:
    data, _ = metrics_csv(s, job_id)
    return list(csv.DictReader(io.StringIO(data.decode())))


def test_a_reinforcement_jobs_csv_has_its_rewards(session: Session) -> None:
    session.add_all(
        [
            JobStepMetric(job_id="ftjob-r", step=1, train_loss=0.0, method_metrics=FIGURES),
            JobStepMetric(
                job_id="ftjob-r",
                step=2,
                train_loss=0.1,
                valid_loss=-0.44,
                method_metrics={**FIGURES, "sub_rewards": {"fuzzy": 0.25}},
            ),
        ]
    )
    session.flush()
    first, second = _rows(session, "ftjob-r")
    assert list(first)[: len(COLUMNS)] == list(COLUMNS)
    assert list(first)[len(COLUMNS) :] == [
        "train_mean_reward",
        "train_min_reward",
        "train_max_reward",
        "train_completion_tokens_mean",
        "train_truncated_fraction",
        "train_grader_errors",
        "train_generation_seconds",
        "train_grading_seconds",
        "valid_mean_reward",
        "train_sub_reward/exact",
        "train_sub_reward/fuzzy",
    ]
    assert (first["train_mean_reward"], first["valid_mean_reward"], first["train_sub_reward/exact"]) == (
        "0.41",
        "",
        "0.5",
    )
    assert (second["valid_mean_reward"], second["train_sub_reward/exact"]) == ("0.44", "")
    assert second["train_sub_reward/fuzzy"] == "0.25" and second["train_grader_errors"] == "2"


def test_other_jobs_csv_keeps_its_columns(session: Session) -> None:
    session.add(JobStepMetric(job_id="ftjob-s", step=1, train_loss=1.5))
    session.flush()
    (row,) = _rows(session, "ftjob-s")
    assert list(row) == list(COLUMNS)

"""Migration 0015 (a step's ``method_metrics``): existing step rows read NULL, a reinforcement step's
figures round-trip as JSON, the schema matches store/orm.py (``zenflow db check``: no drift), and the
downgrade drops the column keeping the rows; PostgreSQL and SQLite."""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import text

from api import migrate
from store.db import make_engine
from tests.store.migrations.r0005 import ROWS
from tests.store.migrations.r0014 import JOB

STEP = (
    "INSERT INTO fine_tuning_job_step_metrics (job_id, step, created_at, train_loss, step_seconds, "
    "stall_seconds, stall_fraction, cpu_optimizer_seconds, bytes_device_to_host, bytes_host_to_device) "
    "VALUES ('ftjob-r', {step}, '2026-01-01 00:00:00+00', 0.5, 1.0, 0.0, 0.0, 0.0, 0, 0)"
)


def check(url: str, tmp: Path) -> None:
    migrate.upgrade(url, "0014")
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            for sql in ROWS:
                conn.execute(text(sql))
            conn.execute(text(JOB.format(id="ftjob-r", status="running")))
            conn.execute(text(STEP.format(step=1)))
        migrate.upgrade(url)
        migrate.check(url)  # no drift against the models
        figures = {"reward_mean": 0.5, "sub_rewards": {"exact": 1.0}}
        with engine.begin() as conn:
            assert conn.execute(text("SELECT method_metrics FROM fine_tuning_job_step_metrics")).all() == [
                (None,)
            ]
            conn.execute(
                text("UPDATE fine_tuning_job_step_metrics SET method_metrics = :m"),
                {"m": json.dumps(figures)},
            )
            got = conn.execute(text("SELECT method_metrics FROM fine_tuning_job_step_metrics")).scalar_one()
        assert (json.loads(got) if isinstance(got, str) else got) == figures
        migrate.downgrade(url, "0014")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT step FROM fine_tuning_job_step_metrics")).all() == [(1,)]
        migrate.upgrade(url)
        migrate.check(url)
    finally:
        engine.dispose()

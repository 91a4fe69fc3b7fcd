"""Migration 0002 (dispatched_at, the queue index) on a database with jobs in it."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import inspect, text

from api import migrate
from store.db import make_engine


def check(url: str, tmp: Path) -> None:
    """0001 -> head backfills dispatched_at of existing jobs; head -> 0001 drops it and keeps the rows
    (on SQLite too: no table re-create, whose DROP would cascade to the events)."""
    migrate.upgrade(url, "0001")
    engine = make_engine(url)
    try:
        with engine.begin() as c:
            c.execute(text("INSERT INTO teams (id, name, created_at) VALUES ('t', 't', '2026-01-01')"))
            c.execute(
                text(
                    "INSERT INTO files (id, team_id, filename, purpose, bytes, sha256, storage_path, "
                    "num_examples, status, created_at) VALUES ('f', 't', 'x', 'fine-tune', 1, '0', 'p', 0, "
                    "'processed', '2026-01-01')"
                )
            )
            for job, status in (("j1", "queued"), ("j2", "validating_files")):
                c.execute(
                    text(
                        "INSERT INTO fine_tuning_jobs (id, team_id, model, training_file_id, status, "
                        "hyperparameters, engine, seed, created_at, queue, cancel_requested, attempts, "
                        "global_step) VALUES (:id, 't', 'm', 'f', :st, '{}', '{}', 0, "
                        "'2026-01-01 00:00:00+00', 'q', false, 0, 0)"
                    ),
                    {"id": job, "st": status},
                )
            c.execute(
                text(
                    "INSERT INTO fine_tuning_job_events (id, job_id, created_at, level, type, message) "
                    "VALUES ('e', 'j1', '2026-01-01', 'info', 'message', 'hi')"
                )
            )
        migrate.upgrade(url)
        migrate.check(url)
        with engine.connect() as c:
            rows = dict(c.execute(text("SELECT id, dispatched_at IS NOT NULL FROM fine_tuning_jobs")).all())
        assert {k: bool(v) for k, v in rows.items()} == {"j1": True, "j2": False}
        assert "ix_fine_tuning_jobs_queue_status_created" in {
            ix["name"] for ix in inspect(engine).get_indexes("fine_tuning_jobs")
        }
        migrate.downgrade(url, "0001")
        engine.dispose()
        cols = {col["name"] for col in inspect(engine).get_columns("fine_tuning_jobs")}
        assert "dispatched_at" not in cols
        with engine.connect() as c:
            assert c.execute(text("SELECT count(*) FROM fine_tuning_job_events")).scalar() == 1
            assert c.execute(text("SELECT count(*) FROM fine_tuning_jobs")).scalar() == 2
    finally:
        engine.dispose()

"""Migration 0014 (a job's ``pause_requested``): existing jobs read false, the schema matches store/orm.py
(``zenflow db check``: no drift), and the downgrade puts a paused job back in its queue (the status does
not exist before it); PostgreSQL and SQLite."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text

from api import migrate
from store.db import make_engine
from tests.store.migrations.r0005 import ROWS

JOB = (
    "INSERT INTO fine_tuning_jobs (id, team_id, model, training_file_id, status, request, resolutions, seed, "
    "created_at, queue, cancel_requested, attempts, global_step, dispatched_at) VALUES ('{id}', 'team-1', "
    "'tiny-llama', 'file-1', '{status}', '{{}}', '[]', 0, '2026-01-01 00:00:00+00', 'q', false, 0, 0, "
    "'2026-01-01 00:00:00+00')"
)


def check(url: str, tmp: Path) -> None:
    migrate.upgrade(url, "0013")
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            for sql in ROWS:
                conn.execute(text(sql))
            for job, status in (("ftjob-q", "queued"), ("ftjob-r", "running")):
                conn.execute(text(JOB.format(id=job, status=status)))
        migrate.upgrade(url)
        migrate.check(url)  # no drift against the models
        with engine.begin() as conn:
            rows = conn.execute(text("SELECT id, pause_requested FROM fine_tuning_jobs ORDER BY id")).all()
            assert [(r[0], bool(r[1])) for r in rows] == [("ftjob-q", False), ("ftjob-r", False)]
            conn.execute(text("UPDATE fine_tuning_jobs SET status = 'paused' WHERE id = 'ftjob-q'"))
        migrate.downgrade(url, "0013")
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT id, status, dispatched_at IS NULL FROM fine_tuning_jobs ORDER BY id")
            ).all()
        assert [(r[0], r[1], bool(r[2])) for r in rows] == [
            ("ftjob-q", "queued", True),
            ("ftjob-r", "running", False),
        ]
        migrate.upgrade(url)
        migrate.check(url)
    finally:
        engine.dispose()

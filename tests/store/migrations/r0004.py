"""Migration 0004 (team quotas, the run ledger) on a database with jobs in it: a job running at the
upgrade gets an open run (its GPU time counts from its last heartbeat), and the downgrade removes
both tables, on PostgreSQL and SQLite."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import inspect, text

from api import migrate
from store.db import make_engine

ROWS = [
    "INSERT INTO teams (id, name, created_at) VALUES ('team-1', 't', '2026-01-01 00:00:00+00')",
    "INSERT INTO files (id, team_id, filename, purpose, bytes, sha256, storage_path, num_examples, status, created_at) "
    "VALUES ('file-1', 'team-1', 'f', 'fine-tune', 1, '0', '/x', 1, 'processed', '2026-01-01 00:00:00+00')",
]
JOB = (
    "INSERT INTO fine_tuning_jobs (id, team_id, model, training_file_id, status, hyperparameters, engine, seed, "
    "created_at, queue, cancel_requested, attempts, global_step, worker_hostname, heartbeat_at) VALUES "
    "('{id}', 'team-1', 'tiny-llama', 'file-1', '{status}', '{{}}', '{{}}', 0, '2026-01-01 00:00:00+00', 'q', "
    "false, 1, 0, 'w@h', '2026-01-02 00:00:00+00')"
)


def check(url: str, tmp: Path) -> None:
    migrate.upgrade(url, "0003")
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            for sql in ROWS:
                conn.execute(text(sql))
            conn.execute(text(JOB.format(id="ftjob-running", status="running")))
            conn.execute(text(JOB.format(id="ftjob-done", status="succeeded")))
        migrate.upgrade(url)
        migrate.check(url)
        with engine.connect() as conn:
            runs = conn.execute(
                text(
                    "SELECT job_id, team_id, queue, worker_hostname, gpus, ended_at FROM fine_tuning_job_runs"
                )
            ).all()
        assert [tuple(r) for r in runs] == [("ftjob-running", "team-1", "q", "w@h", 1, None)]
        migrate.downgrade(url, "0003")
        tables = set(inspect(engine).get_table_names())
        assert "team_quotas" not in tables and "fine_tuning_job_runs" not in tables
        assert "ix_fine_tuning_jobs_team_status" not in {
            i["name"] for i in inspect(engine).get_indexes("fine_tuning_jobs")
        }
    finally:
        engine.dispose()

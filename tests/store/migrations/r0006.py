"""Migration 0006 (the workers registry): the upgrade adds the table with its heartbeat index and
rows go in and out of it; the downgrade removes it and leaves the rest, on PostgreSQL and SQLite."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import inspect, text

from api import migrate
from store.db import make_engine


def check(url: str, tmp: Path) -> None:
    migrate.upgrade(url, "0005")
    engine = make_engine(url)
    try:
        assert "workers" not in inspect(engine).get_table_names()
        migrate.upgrade(url, "0006")
        if migrate.head() == "0006":  # no drift against store/orm.py (later revisions: test_migrations)
            migrate.check(url)
        assert {c["name"] for c in inspect(engine).get_columns("workers")} == {
            "name",
            "queues",
            "capacity",
            "started_at",
            "heartbeat_at",
        }
        assert "ix_workers_heartbeat_at" in {i["name"] for i in inspect(engine).get_indexes("workers")}
        # The ORM of later revisions maps columns 0006 lacks (0007: gpus_per_job): plain SQL here.
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO workers (name, queues, capacity, started_at, heartbeat_at) VALUES "
                    "('w@h', '[\"q\"]', '{\"cores\": 2}', '2026-01-01 00:00:00+00', "
                    "'2026-01-01 00:00:00+00')"
                )
            )
        with engine.connect() as conn:
            assert conn.execute(text("SELECT name FROM workers")).scalars().all() == ["w@h"]
        engine.dispose()
        migrate.downgrade(url, "0005")
        tables = set(inspect(engine).get_table_names())
        assert "workers" not in tables and "teams" in tables
    finally:
        engine.dispose()

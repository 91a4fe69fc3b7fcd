"""Migration 0006 (the workers registry): the upgrade adds the table with its heartbeat index and the
ORM writes and reads rows in it; the downgrade removes it and leaves the rest, on PostgreSQL and SQLite."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import inspect
from sqlalchemy.orm import Session

from api import migrate
from store import workers
from store.db import make_engine
from store.models import Team
from tests.support import create_database, drop_database


def _check(url: str) -> None:
    migrate.upgrade(url, "0005")
    engine = make_engine(url)
    try:
        assert "workers" not in inspect(engine).get_table_names()
        migrate.upgrade(url, "0006")
        if migrate.head() == "0006":  # no drift against store/models.py (later revisions: test_migrations)
            migrate.check(url)
        assert {c["name"] for c in inspect(engine).get_columns("workers")} == {
            "name", "queues", "capacity", "started_at", "heartbeat_at"}
        assert "ix_workers_heartbeat_at" in {i["name"] for i in inspect(engine).get_indexes("workers")}
        with Session(engine) as s:
            s.add(Team(name="t"))
            workers.register(s, "w@h", ["q"], {"device_type": "cpu", "cores": 2})
            s.commit()
            assert [w.name for w in workers.live_workers(s, "q", live_seconds=60)] == ["w@h"]
        engine.dispose()
        migrate.downgrade(url, "0005")
        tables = set(inspect(engine).get_table_names())
        assert "workers" not in tables and "teams" in tables
    finally:
        engine.dispose()


def test_postgresql() -> None:
    url = create_database("zf_api_mig6")
    try:
        _check(url)
    finally:
        drop_database(url)


def test_sqlite(tmp_path: Path) -> None:
    _check(f"sqlite:///{tmp_path / 'zenflow.db'}")

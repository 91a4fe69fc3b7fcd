"""Alembic: upgrade from empty, no drift against store/orm.py (``alembic check``), clean downgrade,
on PostgreSQL and on the embedded SQLite; and the ``zenflow db`` commands."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import inspect, text

from api import migrate
from store.db import make_engine
from store.orm import Base
from tests.support import create_database, drop_database


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _roundtrip(url: str) -> None:
    assert migrate.current(url) is None
    migrate.upgrade(url)
    assert migrate.current(url) == migrate.head()
    assert _tables(url) >= set(Base.metadata.tables)
    migrate.check(url)  # raises on any difference between models and migrated schema
    migrate.upgrade(url)  # idempotent
    migrate.downgrade(url, "base")
    assert _tables(url) <= {"alembic_version"}
    assert migrate.current(url) is None
    migrate.upgrade(url)
    migrate.check(url)


@pytest.mark.services
def test_postgresql_upgrade_check_downgrade() -> None:
    url = create_database("zf_api_mig")
    try:
        _roundtrip(url)
    finally:
        drop_database(url)


def test_sqlite_upgrade_check_downgrade(tmp_path: Path) -> None:
    _roundtrip(f"sqlite:///{tmp_path / 'zenflow.db'}")


def test_zenflow_db_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from api.cli.main import main
    from store.settings import get_settings

    monkeypatch.setenv("ZENFLOW_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("ZENFLOW_DATABASE_URL", raising=False)
    get_settings.cache_clear()
    try:
        assert main(["db", "current"]) == 0
        assert capsys.readouterr().out.strip() == "base"
        assert main(["db", "upgrade"]) == 0
        assert main(["db", "check"]) == 0
        capsys.readouterr()
        assert main(["db", "current"]) == 0
        assert capsys.readouterr().out.strip() == f"{migrate.head()} (head)"
        assert main(["db", "downgrade", "base"]) == 0
        assert (tmp_path / "zenflow.db").exists()
        assert _tables(f"sqlite:///{tmp_path / 'zenflow.db'}") <= {"alembic_version"}
    finally:
        get_settings.cache_clear()


def test_alembic_ini_is_packaged_with_the_versions() -> None:
    from migrations import HERE

    assert (HERE / "alembic.ini").is_file() and (HERE / "env.py").is_file()
    assert list((HERE / "versions").glob("*.py"))


def _dispatched_at_roundtrip(url: str) -> None:
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


@pytest.mark.services
def test_dispatched_at_migration_postgresql() -> None:
    url = create_database("zf_api_mig2")
    try:
        _dispatched_at_roundtrip(url)
    finally:
        drop_database(url)


def test_dispatched_at_migration_sqlite(tmp_path: Path) -> None:
    _dispatched_at_roundtrip(f"sqlite:///{tmp_path / 'zenflow.db'}")

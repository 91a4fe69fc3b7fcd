"""Alembic: upgrade from empty, no drift against store/models.py (``alembic check``), clean downgrade,
on PostgreSQL and on the embedded SQLite; and the ``zenflow db`` commands."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import inspect

from api import migrate
from store.db import make_engine
from store.models import Base
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
    from api.cli import main
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

"""Alembic, through one harness on PostgreSQL and on the embedded SQLite: upgrade from empty, no drift
against store/orm.py (``alembic check``), clean downgrade; every revision that moves data
(tests/store/migrations: one ``check(url, tmp)`` each) on a database holding rows of the revision
before; and the ``zenflow db`` commands."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import inspect

from api import migrate
from store.db import make_engine
from store.orm import Base
from tests.store import migrations
from tests.support import create_database, drop_database

#: The revisions with a data check of their own (tests/store/migrations/rNNNN.py).
CASES = sorted(m.name for m in pkgutil.iter_modules(migrations.__path__))


@pytest.fixture(params=[pytest.param("postgresql", marks=pytest.mark.services), "sqlite"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database of each dialect: a fresh PostgreSQL one (dropped after), or a SQLite file."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'zenflow.db'}"
        return
    url = create_database("zf_mig")
    try:
        yield url
    finally:
        drop_database(url)


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_check_downgrade(db_url: str) -> None:
    assert migrate.current(db_url) is None
    migrate.upgrade(db_url)
    assert migrate.current(db_url) == migrate.head()
    assert _tables(db_url) >= set(Base.metadata.tables)
    migrate.check(db_url)  # raises on any difference between models and migrated schema
    migrate.upgrade(db_url)  # idempotent
    migrate.downgrade(db_url, "base")
    assert _tables(db_url) <= {"alembic_version"}
    assert migrate.current(db_url) is None
    migrate.upgrade(db_url)
    migrate.check(db_url)


@pytest.mark.parametrize("case", CASES)
def test_revision_moves_the_data(case: str, db_url: str, tmp_path: Path) -> None:
    importlib.import_module(f"{migrations.__name__}.{case}").check(db_url, tmp_path)


def test_every_data_revision_has_a_case() -> None:
    """A revision whose upgrade reads or writes rows (op.get_bind / op.execute) has its check here."""
    versions = Path(migrate.__file__).resolve().parents[1] / "migrations" / "versions"
    moving = {
        f"r{p.name[:4]}"
        for p in versions.glob("*.py")
        if "op.get_bind()" in p.read_text() or "op.execute(" in p.read_text()
    }
    assert moving <= set(CASES), f"revisions that move data without a check: {sorted(moving - set(CASES))}"


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

"""Run the Alembic migrations programmatically (``zenflow db ...``, the API's start-up, the tests)."""

from __future__ import annotations

import logging
import time

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from migrations import HERE
from store.db import make_engine, normalize_url

log = logging.getLogger(__name__)


def alembic_config(url: str | None = None) -> Config:
    cfg = Config(str(HERE / "alembic.ini"))
    cfg.set_main_option("script_location", str(HERE))
    cfg.attributes["skip_logging"] = True
    if url:
        cfg.attributes["url"] = normalize_url(url)
    return cfg


def upgrade(url: str | None = None, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str | None = None, revision: str = "-1") -> None:
    command.downgrade(alembic_config(url), revision)


def current(url: str) -> str | None:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def check(url: str | None = None) -> None:
    """Raise alembic.util.CommandError when the models and the migrated schema differ."""
    command.check(alembic_config(url))


def upgrade_with_retry(url: str, *, wait_seconds: float = 60.0) -> None:
    """Upgrade to head, retrying while the database is still starting (compose, k8s)."""
    from sqlalchemy.exc import OperationalError

    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            upgrade(url)
            return
        except OperationalError:
            if time.monotonic() > deadline:
                raise
            log.warning("database not reachable yet; retrying the migration")
            time.sleep(2.0)

"""Alembic environment: store.orm metadata, the URL from the caller or from ZENFLOW_ settings."""

from __future__ import annotations

import logging
from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection, text

from store.db import make_engine, normalize_url
from store.orm import Base
from store.settings import get_settings

config = context.config
target_metadata = Base.metadata

# Only configure logging when run by the alembic CLI, not when the API or tests call us in-process.
if config.config_file_name is not None and not config.attributes.get("skip_logging"):
    fileConfig(config.config_file_name, disable_existing_loggers=False)
log = logging.getLogger("alembic.env")

#: Serializes concurrent upgrades (several API replicas starting at once) on PostgreSQL.
ADVISORY_LOCK_ID = 0x5A454E464C4F57  # "ZENFLOW"


def _url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url") or ""
    return normalize_url(url or get_settings().resolved_database_url)


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        compare_server_default=True,
    )


def run_offline() -> None:
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=_url().startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(_url(), bounded=False)  # a long ALTER; the lock between replicas
    try:
        with engine.connect() as conn:
            _configure(conn)
            with context.begin_transaction():
                if conn.dialect.name == "postgresql":
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": ADVISORY_LOCK_ID})
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()

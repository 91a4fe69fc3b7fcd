"""Engine and session factories for PostgreSQL (psycopg) and the embedded SQLite file."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry

from store.db_deadline import BoundedConnection
from store.settings import get_settings

#: TCP keepalives on every PostgreSQL connection: a peer that vanished (its host gone) is found within
#: about a minute. A peer that is there and never answers is the operation bound's (store.db_deadline).
PG_KEEPALIVES: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}


def normalize_url(url: str) -> str:
    """Use the psycopg (v3) driver for bare postgresql:// URLs."""
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    return u.render_as_string(hide_password=False)


def make_engine(url: str, *, bounded: bool = True) -> Engine:
    url = normalize_url(url)
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        if u.database and u.database != ":memory:":
            Path(u.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    return _postgres_engine(url, bounded=bounded)


def _postgres_engine(url: str, *, bounded: bool) -> Engine:
    """A pooled engine whose every wait is bounded by the settings' ``database_*_timeout_seconds``
    (``bounded=False``: all but the operation bound, for schema migrations)."""
    settings = get_settings()
    engine = create_engine(
        url,
        pool_size=10,
        max_overflow=20,
        pool_recycle=1800,
        pool_timeout=settings.database_pool_timeout_seconds,
        connect_args={**PG_KEEPALIVES, "connect_timeout": settings.database_connect_timeout_seconds},
    )
    operation = settings.database_operation_timeout_seconds if bounded else None
    ping = settings.database_ping_timeout_seconds

    @event.listens_for(engine, "do_connect")
    def _connect(_dialect: Any, _record: ConnectionPoolEntry, cargs: Any, cparams: Any) -> BoundedConnection:
        conn = BoundedConnection.connect(*cargs, **cparams)
        conn.operation_seconds = operation
        return conn

    @event.listens_for(engine, "connect")
    def _fresh(_conn: DBAPIConnection, record: ConnectionPoolEntry) -> None:
        record.info["zenflow_fresh"] = True

    @event.listens_for(engine, "checkout")
    def _ping(conn: DBAPIConnection, record: ConnectionPoolEntry, _proxy: Any) -> None:
        # SQLAlchemy's pool_pre_ping, with its own short bound: a pooled connection to a database that
        # stopped answering is dropped after ``ping`` seconds and a new one tried (bounded by the
        # connect timeout), not used for a statement that would wait the operation bound.
        if record.info.pop("zenflow_fresh", False):
            return
        assert isinstance(conn, BoundedConnection)
        try:
            with conn.deadline(ping):
                engine.dialect.do_ping(conn)
        except psycopg.Error as exc:
            raise DisconnectionError(f"pooled connection failed its check: {exc}") from exc

    return engine


@lru_cache(maxsize=8)
def get_engine(url: str | None = None) -> Engine:
    return make_engine(url or get_settings().resolved_database_url)


def session_factory(url: str | None = None) -> sessionmaker[Session]:
    return sessionmaker(bind=get_engine(url), expire_on_commit=False)


@contextmanager
def session_scope(url: str | None = None) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    session = session_factory(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()

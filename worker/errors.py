"""What the worker service may tell a user about an exception, and which database errors are passing.

Every exception message that becomes user-visible (``job.error``, a job event) goes through
:func:`public_message`: an error from SQLAlchemy or psycopg becomes ``database unavailable
(AdminShutdown)`` (a lost connection, a server shutting down, a pool timeout: the kind the job process
waits out) or ``database error (NumericValueOutOfRange)``, never the SQL text and parameters
SQLAlchemy puts into its messages; any other message is cut before such a ``[SQL: ...]`` block
(:func:`scrub`) and to a bounded length.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
from sqlalchemy import exc as sa_exc

#: Longest message a user sees from an exception.
MAX_MESSAGE_CHARS = 2000

_CUT_AT = ("[SQL:", "[parameters:", "(Background on this error at:")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or during, each once."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _db_error(exc: BaseException) -> BaseException | None:
    return next((e for e in _chain(exc) if isinstance(e, sa_exc.SQLAlchemyError | psycopg.Error)), None)


def is_db_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database cannot be reached right now (worth retrying on a new
    connection): a dropped or refused connection, a server shutting down or restarting, a pool timeout,
    a deadlock or serialization failure, SQLite's "database is locked"."""
    for e in _chain(exc):
        if isinstance(e, sa_exc.DBAPIError) and e.connection_invalidated:
            return True
        if isinstance(
            e,
            sa_exc.OperationalError
            | sa_exc.InterfaceError
            | sa_exc.DisconnectionError
            | sa_exc.TimeoutError
            | psycopg.OperationalError
            | psycopg.InterfaceError,
        ):
            return True
    return False


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


def scrub(text: str) -> str:
    """``text`` without SQLAlchemy's ``[SQL: ...]``/``[parameters: ...]`` tail, bounded in length."""
    for marker in _CUT_AT:
        text = text.split(marker, 1)[0]
    return _bounded(text.strip())


def public_message(exc: BaseException) -> str:
    """The message a user may see for ``exc`` (see the module docstring)."""
    db = _db_error(exc)
    if db is not None:
        orig = db.orig if isinstance(db, sa_exc.DBAPIError) and db.orig is not None else db
        what = "database unavailable" if is_db_unavailable(exc) else "database error"
        return f"{what} ({type(orig).__name__})"
    text = scrub(str(exc))
    return _bounded(f"{type(exc).__name__}: {text}") if text else type(exc).__name__

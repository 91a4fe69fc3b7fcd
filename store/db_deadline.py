"""A client-side time bound on every network wait of a PostgreSQL connection.

A database that accepts bytes and never answers (a stopped proxy, a frozen host, a stuck PgBouncer) is
invisible to TCP: the peer's kernel acknowledges what is sent, so keepalives and ``tcp_user_timeout``
never fire, and a server-side ``statement_timeout`` needs a server that runs. psycopg consumes every
operation on an open connection (a statement, a commit, a fetch) through ``Connection.wait``;
:class:`BoundedConnection` arms a deadline around it, and one watchdog thread per process shuts down the
socket of an operation past its deadline. The blocked call then fails at once like a connection the
server closed, psycopg marks the connection broken, and SQLAlchemy drops it from its pool.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg


class _Watchdog:
    """Shuts down the socket of each armed operation whose deadline passed (one thread, started on
    first use, started again in a forked child)."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[int, tuple[float, int]] = {}  # key -> (monotonic deadline, socket fd)
        self._fired: set[int] = set()
        self._thread: threading.Thread | None = None

    def arm(self, key: int, fd: int, seconds: float) -> None:
        with self._cond:
            self._due[key] = (time.monotonic() + seconds, fd)
            self._fired.discard(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="db-deadline", daemon=True)
                self._thread.start()
            self._cond.notify()

    def disarm(self, key: int) -> bool:
        """Forget ``key``'s deadline; True when it had passed (its socket was shut down)."""
        with self._cond:
            self._due.pop(key, None)
            fired = key in self._fired
            self._fired.discard(key)
            return fired

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for key, (due, fd) in list(self._due.items()):
                    if due <= now:
                        del self._due[key]
                        self._fired.add(key)
                        _shut_down(fd)  # under the lock: disarm (before the fd is closed) waits for it
                nearest = min((due for due, _ in self._due.values()), default=None)
                self._cond.wait(None if nearest is None else max(nearest - now, 0.0))


def _shut_down(fd: int) -> None:
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by its peer


_WATCHDOG = _Watchdog()


class BoundedConnection(psycopg.Connection[Any]):
    """A psycopg connection whose every network wait ends within ``operation_seconds`` (None: no bound).

    SQLAlchemy creates it through the engine's ``do_connect`` hook (store.db); :meth:`deadline` bounds
    one block more tightly (the pool's liveness check)."""

    operation_seconds: float | None = None

    def wait(self, gen: Any, *args: Any, **kwargs: Any) -> Any:
        seconds = self.operation_seconds
        if seconds is None:
            return super().wait(gen, *args, **kwargs)
        key = id(self)
        _WATCHDOG.arm(key, self.pgconn.socket, seconds)
        try:
            result = super().wait(gen, *args, **kwargs)
        except psycopg.Error as exc:
            if _WATCHDOG.disarm(key):
                self.close()
                raise psycopg.OperationalError(f"the database did not answer within {seconds:g} s") from exc
            raise
        if _WATCHDOG.disarm(key):  # the answer came as the deadline passed: its socket is shut
            self.close()
        return result

    @contextmanager
    def deadline(self, seconds: float) -> Iterator[None]:
        before = self.operation_seconds
        self.operation_seconds = seconds
        try:
            yield
        finally:
            self.operation_seconds = before

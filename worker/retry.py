"""Retrying database work across connection drops: exponential backoff, and an outage window.

The pool's ``pool_pre_ping`` replaces a dead pooled connection at checkout, but a connection that dies
during a transaction (``pg_terminate_backend``, a failover, a restart) fails that transaction; these
helpers run it again on a fresh connection until it goes through or the outage has lasted longer than
its window (``Settings.job_db_outage_seconds``).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from worker.errors import is_db_unavailable, public_message

log = logging.getLogger("zenflow.worker")

T = TypeVar("T")


class DatabaseUnavailable(RuntimeError):
    """The database stayed unreachable for longer than the window; the message is user-safe."""


class Backoff:
    """Delays that double from ``first`` up to ``cap``, each with up to 25% random jitter (so the
    processes of a fleet do not reconnect in step)."""

    def __init__(self, first: float = 0.1, cap: float = 5.0) -> None:
        self.first, self.cap = first, cap
        self._next = first

    def next(self) -> float:
        delay = self._next
        self._next = min(self.cap, self._next * 2)
        return delay * (1.0 + random.random() / 4)

    def reset(self) -> None:
        self._next = self.first


def retry_db(
    fn: Callable[[], T],
    *,
    window: float,
    what: str,
    stop: threading.Event | None = None,
    backoff: Backoff | None = None,
) -> T:
    """``fn()``, run again with backoff while it fails because the database is unavailable, for up to
    ``window`` seconds from the first failure; then (or once ``stop`` is set) :class:`DatabaseUnavailable`.
    Any other error is raised at once. ``fn`` is one transaction: it must be safe to run again."""
    backoff = backoff or Backoff()
    deadline: float | None = None
    while True:
        try:
            return fn()
        except Exception as e:
            if not is_db_unavailable(e):
                raise
            now = time.monotonic()
            if deadline is None:
                deadline = now + window
                log.warning("%s: %s; retrying for up to %.0f s", what, public_message(e), window)
            if now >= deadline or (stop is not None and stop.is_set()):
                raise DatabaseUnavailable(f"{public_message(e)} for more than {window:g} s") from e
            delay = min(backoff.next(), deadline - now)
            if stop is not None:
                stop.wait(delay)
            else:
                time.sleep(delay)

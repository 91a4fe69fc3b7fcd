"""prometheus-client's multiprocess mode, shared by the worker's metrics server and the API's /metrics.

With ``PROMETHEUS_MULTIPROC_DIR`` set before prometheus_client is imported, every process writes its
samples into mmap files in that directory and a reader merges them at scrape time.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

from prometheus_client import values

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_mode() -> bool:
    """Whether this process's metric values live in multiprocess files (decided when prometheus_client
    was imported)."""
    return values.ValueClass is not values.MutexValue


def multiprocess_dir() -> str | None:
    """The directory of this process's multiprocess files, when that mode is on and it exists."""
    path = os.environ.get(MULTIPROC_ENV)
    return path if path and os.path.isdir(path) and multiprocess_mode() else None


@contextlib.contextmanager
def dir_lock(path: str, exclusive: bool) -> Iterator[None]:
    """flock on the directory's ``.lock``: readers share it; wiping and folding files take it alone."""
    fd = os.open(os.path.join(path, ".lock"), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

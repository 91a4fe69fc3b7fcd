"""A team's stored bytes: uploaded files, result files and job outputs (checkpoints, final models).

What a storage quota is checked against (:func:`team_storage_bytes`) and what ``zenflow storage
usage`` prints (:func:`team_storage_usage`). Files carry their size in their rows, so they are one
``SUM`` per team. Job outputs are directories the workers write; each job's output directory is
measured on disk once and its size cached, keyed by the directory's identity and change times:
checkpoints and the final model appear and go by rename or removal directly under the job's output
directory (the atomic writes of ``trainer.run.checkpoint``), which changes its mtime, so one ``stat`` per
job says whether the cached size still holds, and this holds across processes (a purge run from the
CLI is seen by the API's next call). Entries also expire after ``max_age`` seconds, a backstop for
file systems with coarse timestamps. Files hard-linked into several places of one output directory
(the final model shares its weights with the last checkpoint) are counted once.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from store.orm import File, FineTuningJob
from store.results import RESULTS_PURPOSE

#: ``files.status`` of a file whose bytes were removed while finished jobs still name it (the row
#: stays for their ``training_file``/``validation_file``); it is no longer listed, served or counted.
DELETED_FILE_STATUS = "deleted"


@dataclass(frozen=True)
class StorageUsage:
    """A team's stored bytes by kind."""

    team_id: str
    #: Uploaded training and validation files.
    uploads_bytes: int
    #: Result files the jobs produced (``fine-tune-results``).
    results_bytes: int
    #: Job output directories: checkpoints, final models, run results.
    jobs_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.uploads_bytes + self.results_bytes + self.jobs_bytes


def directory_bytes(path: str | Path) -> int:
    """Bytes of the regular files under ``path`` (each inode once, symbolic links not followed);
    0 when it does not exist. Files vanishing during the walk are skipped."""
    total = 0
    seen: set[tuple[int, int]] = set()
    stack = [os.fspath(path)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                stack.append(entry.path)
            elif stat.S_ISREG(st.st_mode):
                key = (st.st_dev, st.st_ino)
                if st.st_nlink > 1:
                    if key in seen:
                        continue
                    seen.add(key)
                total += st.st_size
    return total


class DirectorySizeCache:
    """Sizes of job output directories, each valid while the directory's stat signature holds."""

    def __init__(self, max_age: float = 300.0) -> None:
        self.max_age = max_age
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[tuple[int, int, int, int], float, int]] = {}

    def size(self, path: str) -> int:
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            with self._lock:
                self._entries.pop(path, None)
            return 0
        sig = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
        now = time.monotonic()
        with self._lock:
            hit = self._entries.get(path)
        if hit is not None and hit[0] == sig and now - hit[1] < self.max_age:
            return hit[2]
        size = directory_bytes(path)
        with self._lock:
            self._entries[path] = (sig, now, size)
        return size

    def forget(self, path: str | Path) -> None:
        with self._lock:
            self._entries.pop(os.fspath(path), None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


#: The process's cache (the API's requests and the CLI share it within a process).
OUTPUT_SIZES = DirectorySizeCache()


def team_storage_usage(
    session: Session, team_id: str, *, cache: DirectorySizeCache | None = None
) -> StorageUsage:
    """The team's stored bytes by kind: two indexed queries and one ``stat`` per job with outputs."""
    cache = cache or OUTPUT_SIZES
    by_purpose = session.execute(
        select(File.purpose, func.coalesce(func.sum(File.bytes), 0))
        .where(File.team_id == team_id, File.status != DELETED_FILE_STATUS)
        .group_by(File.purpose)
    ).all()
    results = sum(int(n) for purpose, n in by_purpose if purpose == RESULTS_PURPOSE)
    uploads = sum(int(n) for purpose, n in by_purpose if purpose != RESULTS_PURPOSE)
    dirs = session.scalars(
        select(FineTuningJob.output_dir).where(
            FineTuningJob.team_id == team_id, FineTuningJob.output_dir.is_not(None)
        )
    ).all()
    jobs = sum(cache.size(d) for d in dirs if d)
    return StorageUsage(team_id=team_id, uploads_bytes=uploads, results_bytes=results, jobs_bytes=jobs)


def team_storage_bytes(session: Session, team_id: str) -> int:
    """Everything the team stores, in bytes: what a storage quota is checked against."""
    return team_storage_usage(session, team_id).total_bytes

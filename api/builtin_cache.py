"""Built-in configs' weights at a seed, written on demand for download and kept within a byte budget.

A built-in model has no files: ``GET /v1/models/{builtin}/content?seed=S`` writes its random init at S
(the base an adapter trained with that seed goes onto) as a ``from_pretrained`` folder under the cache's
root. Any key may ask for any seed, so the folders are a cache, not a store: the least recently used
ones are removed to keep the total within the budget, never one a download of this process is still
sending (such a folder may hold the total above the budget until it is sent). A folder removed under
another replica's download ends that download early; the client resumes it with ``Range`` and gets the
same bytes (the weights at a seed are deterministic). One folder is written at a time per process.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

#: The cache's folder under ``data_dir``: one folder per built-in name and seed.
BUILTIN_DIR = "builtin-models"
WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class CacheUsage:
    bytes: int
    folders: int
    budget_bytes: int


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


class BuiltinCache:
    def __init__(self, root: Path, budget_bytes: int) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._sending: Counter[Path] = Counter()

    @contextmanager
    def folder(self, name: str, seed: int) -> Iterator[Path]:
        """The folder of ``name`` at ``seed`` (written if missing), kept while the block runs."""
        path = self.root / f"{name}-seed{seed}"
        with self._lock:
            if not (path / WEIGHTS).is_file():
                self._evict(making=name)
                _write(name, seed, path)
            os.utime(path)  # the least recently used goes first
            self._sending[path] += 1
        try:
            yield path
        finally:
            with self._lock:
                self._sending[path] -= 1
                if not self._sending[path]:
                    del self._sending[path]
                self._evict()

    def sweep_partial(self, max_age_seconds: float) -> None:
        """Remove folders a killed process left half-written (younger ones may be another replica's
        write in progress)."""
        if not self.root.is_dir():
            return
        for p in self.root.iterdir():
            if p.name.startswith(".") and time.time() - p.stat().st_mtime > max_age_seconds:
                shutil.rmtree(p, ignore_errors=True)

    def usage(self) -> CacheUsage:
        folders = self._folders()
        return CacheUsage(sum(size for _, size in folders), len(folders), self.budget_bytes)

    def _folders(self) -> list[tuple[Path, int]]:
        """Complete folders, least recently used first, with their sizes."""
        if not self.root.is_dir():
            return []
        done = [p for p in self.root.iterdir() if not p.name.startswith(".") and (p / WEIGHTS).is_file()]
        done.sort(key=lambda p: p.stat().st_mtime_ns)
        return [(p, _size(p)) for p in done]

    def _evict(self, making: str | None = None) -> None:
        """Remove least recently used folders not being sent until the total fits the budget, with room
        for a new folder of ``making`` (the size of one at another seed, if there is one)."""
        folders = self._folders()
        room = next((size for p, size in folders if making and p.name.startswith(f"{making}-seed")), 0)
        total = sum(size for _, size in folders)
        for path, size in folders:
            if total + room <= self.budget_bytes:
                return
            if path in self._sending:
                continue
            shutil.rmtree(path, ignore_errors=True)
            total -= size


def _write(name: str, seed: int, folder: Path) -> None:
    """The built-in model at ``seed`` as a from_pretrained folder: the weights a job with that seed
    starts from (float32), its config and the byte-level tokenizer."""
    import torch

    from trainer.model.catalog import load_model, load_tokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        tokenizer = load_tokenizer(name)
        model = load_model(name, dtype=torch.float32, seed=seed, tokenizer=tokenizer)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        try:
            os.replace(tmp, folder)
        except OSError:  # written meanwhile by another replica: keep that one
            if not (folder / WEIGHTS).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

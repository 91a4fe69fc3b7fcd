"""Server paths in what a job reports, as the API shows them: never the server's own folders.

The runner and the trainer know a job's files by their paths on the server (the uploaded data under
``files_dir``, the outputs under ``jobs_dir``, a base model under a model root) and say so in event
messages and data (``{"path": ...}`` of a dataset report, a checkpoint, a resume; a plan's model).
The API refuses server paths as input and does not show them either: each one becomes the name the
API knows it by, relative to its root:

- an uploaded file (``files_dir/<team>/<file id>.jsonl``): its file id (a data ``path`` key that
  held one becomes ``file_id``);
- a base model under a model root: its path below the root, the model's name in the API;
- a job output (``jobs_dir/<job id>/checkpoint-000010``): ``<job id>/checkpoint-000010``;
- anything else under the data directory: its path below it.

Any other absolute path that is a whole value of event data is cut to its last component.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

from store.settings import Settings

_FILE_ID = re.compile(r"^(file-[A-Za-z0-9_-]+)\.jsonl$")
#: Characters that end a path inside a message (spaces, quotes, brackets, punctuation around it).
_PATH_CHARS = r"[^\s'\"`,;()\[\]{}<>]"
_ABSOLUTE = re.compile(rf"^/{_PATH_CHARS}*$")


def _file_name(rel: PurePosixPath) -> str:
    m = _FILE_ID.match(rel.name)
    return m.group(1) if m else rel.name


def _relative(rel: PurePosixPath) -> str:
    return rel.as_posix()


class PublicPaths:
    """Rewrites server paths under the service's folders (``roots``: path, rename) in text and data."""

    def __init__(self, roots: tuple[tuple[str, str], ...]) -> None:
        names: dict[str, Callable[[PurePosixPath], str]] = {
            "file": _file_name,
            "model": _relative,
            "job": _relative,
            "data": _relative,
        }
        # Longest first: a root inside another one (files_dir under data_dir) is matched as itself.
        # Absolute roots only (a relative one, "var", would match inside words).
        ordered = sorted({r for r in roots if r[0].startswith("/") and r[0] != "/"}, key=lambda r: -len(r[0]))
        self._rename = {root.rstrip("/"): names[kind] for root, kind in ordered}
        self._kinds = {root.rstrip("/"): kind for root, kind in ordered}
        alternatives = "|".join(re.escape(root.rstrip("/")) for root, _ in ordered)
        # A root starts a path (not inside another one) and ends at a "/" or the path's end.
        self._pattern = (
            re.compile(rf"(?<![\w./-])(?:{alternatives})(?:/{_PATH_CHARS}*)?(?!{_PATH_CHARS})")
            if ordered
            else None
        )

    @staticmethod
    def of(settings: Settings) -> PublicPaths:
        roots: list[tuple[str, str]] = []
        for path, kind in (
            (settings.files_dir or settings.data_dir / "files", "file"),
            (settings.jobs_dir or settings.data_dir / "jobs", "job"),
            *((root, "model") for root in settings.model_roots),
            (settings.data_dir, "data"),
        ):
            roots += [(str(path), kind), (str(path.resolve()), kind)]  # as given, and resolved
        return _cached(tuple(roots))

    def _public(self, match: re.Match[str]) -> str:
        text = match.group(0)
        for root, rename in self._rename.items():
            if text == root or text.startswith(root + "/"):
                rel = PurePosixPath(text[len(root) :].lstrip("/"))
                return rename(rel) if rel.parts else "."
        return text  # pragma: no cover - the pattern matches the roots only

    def text(self, value: str) -> str:
        """``value`` with every path under the service's folders replaced by its public name."""
        return self._pattern.sub(self._public, value) if self._pattern is not None else value

    def is_file(self, value: str) -> bool:
        """Whether ``value`` is an uploaded file's path."""
        return any(
            self._kinds[root] == "file"
            and value.startswith(root + "/")
            and _FILE_ID.match(PurePosixPath(value).name)
            for root in self._kinds
        )

    def data(self, value: Any) -> Any:
        """Event data (JSON-like) with no server path: see the module's docstring."""
        if isinstance(value, str):
            public = self.text(value)
            return PurePosixPath(public).name if _ABSOLUTE.match(public) else public
        if isinstance(value, list):
            return [self.data(v) for v in value]
        if isinstance(value, dict):
            out: dict[str, Any] = {}
            for key, v in value.items():
                if key == "path" and isinstance(v, str) and self.is_file(v):
                    out["file_id"] = self.text(v)
                else:
                    out[key] = self.data(v)
            return out
        return value


@functools.lru_cache(maxsize=8)
def _cached(roots: tuple[tuple[str, str], ...]) -> PublicPaths:
    return PublicPaths(roots)

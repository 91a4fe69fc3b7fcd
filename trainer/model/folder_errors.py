"""The error of a base-model folder a job cannot train on (trainer.model.folder_check and
trainer.model.weight_shapes raise it; ``trainer.model.folder_check.ModelFolderError`` is the same class)."""

from __future__ import annotations

from pathlib import Path


class ModelFolderError(ValueError):
    """A local model folder a job cannot train on; the message says which file and why."""

    def __init__(self, path: Path | str, problem: str) -> None:
        self.path, self.problem = Path(path), problem
        super().__init__(f"model folder {path}: {problem}")


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters), or its class name."""
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]

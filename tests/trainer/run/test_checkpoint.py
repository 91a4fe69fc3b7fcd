"""Atomic checkpoint directories: only complete ones are found, leftovers are cleaned, pruning."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.run.checkpoint import (
    MANIFEST,
    checkpoint_name,
    cleanup_partial,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    write_atomic_dir,
)


def _save(out: Path, step: int) -> Path:
    def write(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"x" * step)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.json").write_text("{}")

    return write_atomic_dir(out / checkpoint_name(step), write, {"kind": "checkpoint", "step": step})


def test_atomic_write_and_newest_complete(tmp_path: Path) -> None:
    for s in (5, 10, 15):
        _save(tmp_path, s)
    assert [c.step for c in list_checkpoints(tmp_path)] == [5, 10, 15]
    # A crash mid-write leaves only a .tmp- directory: never picked.
    (tmp_path / f"{checkpoint_name(20)}.tmp-dead").mkdir()
    # A directory with the final name but a truncated file or no manifest is not complete either.
    bad = _save(tmp_path, 25)
    (bad / "model.safetensors").write_bytes(b"x")
    (tmp_path / checkpoint_name(30)).mkdir()
    assert not is_complete(bad) and latest_checkpoint(tmp_path).step == 15  # type: ignore[union-attr]
    assert latest_checkpoint(tmp_path).manifest["files"]["sub/a.json"] == 2  # type: ignore[union-attr]
    assert [p.name for p in cleanup_partial(tmp_path)] == [f"{checkpoint_name(20)}.tmp-dead"]


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    def boom(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomic_dir(tmp_path / checkpoint_name(1), boom, {"step": 1})
    assert list(tmp_path.iterdir()) == []


def test_resave_replaces_and_prune(tmp_path: Path) -> None:
    _save(tmp_path, 3)
    p = _save(tmp_path, 3)
    assert is_complete(p) and (p / MANIFEST).is_file() and len(list(tmp_path.iterdir())) == 1
    for s in (6, 9, 12):
        _save(tmp_path, s)
    removed = prune_checkpoints(tmp_path, 2)
    assert [c.step for c in removed] == [3, 6] and [c.step for c in list_checkpoints(tmp_path)] == [9, 12]
    assert prune_checkpoints(tmp_path, None) == []


def test_space_short_names_the_free_space_the_checkpoint_and_what_is_kept_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    from types import SimpleNamespace

    from trainer.run import checkpoint

    _save(tmp_path, 6)
    need = sum(latest_checkpoint(tmp_path).manifest["files"].values())  # type: ignore[union-attr]
    kept = 1 << 20

    def statvfs(free: int) -> SimpleNamespace:
        return SimpleNamespace(f_bavail=free, f_frsize=1)

    monkeypatch.setattr(os, "statvfs", lambda _p: statvfs(need + kept))
    assert checkpoint.space_short(tmp_path) is None
    monkeypatch.setattr(os, "statvfs", lambda _p: statvfs(need + kept - 1))  # room for it, not the margin
    assert checkpoint.space_short(tmp_path) == (
        "no space left for another checkpoint: 1.0 MiB free where checkpoint-000006 (step 6) takes "
        "0.0 MiB and 1.0 MiB is kept free"
    )

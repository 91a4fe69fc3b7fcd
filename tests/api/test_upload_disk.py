"""Uploads against a real full file system (a small tmpfs as files_dir, as tests/faults/test_disk_full.py
mounts one): 507 with a clear message and nothing left behind (no temp file, no stored file, no row),
whether the disk is full before the upload or fills while it streams in; and the sweep of upload temp
files a killed API left behind, at start, sparing young ones (another replica's upload in progress)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from store.orm import File
from store.settings import Settings
from tests.api.conftest import TEST_API_SETTINGS, Enqueued, TeamKey, error_of, make_team, upload
from tests.faults.test_disk_full import fill, small_filesystem


def _jsonl(n_bytes: int) -> bytes:
    line = json.dumps({"prompt": "x" * 200, "completion": "y"}).encode() + b"\n"
    return line * (n_bytes // len(line) + 1)


def _rows(client: TestClient, team: TeamKey) -> int:
    with client.app.state.sessionmaker() as s:  # type: ignore[attr-defined]
        return int(s.scalar(select(func.count()).select_from(File).where(File.team_id == team.id)) or 0)


def _stored(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.name.startswith("filler")
    )


@pytest.fixture
def small_files_dir(tmp_path: Path) -> Iterator[Path]:
    with small_filesystem(tmp_path / "files", 1) as root:  # 1 MiB
        yield root


@pytest.fixture
def disk_client(settings: Settings, small_files_dir: Path) -> Iterator[TestClient]:
    from api.app import create_app

    s = settings.model_copy(update={"files_dir": small_files_dir, "max_upload_bytes": 4 * 1024 * 1024})
    with TestClient(create_app(s, TEST_API_SETTINGS, enqueue=Enqueued())) as c:
        yield c


def _assert_507_and_nothing_kept(r: object, client: TestClient, team: TeamKey, root: Path) -> None:
    assert getattr(r, "status_code", None) == 507, getattr(r, "text", r)
    err = error_of(r)
    assert err["code"] == "insufficient_storage" and err["type"] == "server_error" and err["param"] == "file"
    assert "no storage left" in str(err["message"]) and "nothing was kept" in str(err["message"])
    assert _stored(root) == [] and _rows(client, team) == 0


def test_full_disk_upload_is_507_and_leaves_nothing(disk_client: TestClient, small_files_dir: Path) -> None:
    team = make_team(disk_client.app)  # type: ignore[arg-type]
    filler = fill(small_files_dir)
    r = upload(disk_client, team, _jsonl(64 * 1024))
    _assert_507_and_nothing_kept(r, disk_client, team, small_files_dir)
    filler.unlink()  # space back: the same upload is stored
    r = upload(disk_client, team, _jsonl(64 * 1024))
    assert r.status_code == 200, r.text
    assert _rows(disk_client, team) == 1


def test_disk_filling_during_the_upload_is_507_and_leaves_nothing(
    disk_client: TestClient, small_files_dir: Path
) -> None:
    team = make_team(disk_client.app)  # type: ignore[arg-type]
    filler = small_files_dir / "filler-partial"
    filler.write_bytes(b"\0" * (700 * 1024))  # ~300 KiB left: the 600 KiB upload runs out midway
    assert os.statvfs(small_files_dir).f_bavail * os.statvfs(small_files_dir).f_frsize < 600 * 1024
    r = upload(disk_client, team, _jsonl(600 * 1024))
    _assert_507_and_nothing_kept(r, disk_client, team, small_files_dir)
    filler.unlink()
    assert upload(disk_client, team, _jsonl(600 * 1024)).status_code == 200


def test_stale_upload_temp_files_are_swept_at_start(settings: Settings, tmp_path: Path) -> None:
    from api.app import create_app

    files_dir = tmp_path / "files"
    incoming = files_dir / ".incoming"
    incoming.mkdir(parents=True)
    old, young, other = incoming / "a1.part", incoming / "b2.part", incoming / "keep.txt"
    for p in (old, young, other):
        p.write_bytes(b"partial upload")
    hours_ago = time.time() - 2 * 3600
    os.utime(old, (hours_ago, hours_ago))
    os.utime(other, (hours_ago, hours_ago))

    s = settings.model_copy(update={"files_dir": files_dir})
    api_settings = TEST_API_SETTINGS.model_copy(update={"stale_upload_seconds": 3600})
    with TestClient(create_app(s, api_settings, enqueue=Enqueued())) as c:
        assert c.get("/healthz").status_code == 200
        assert not old.exists(), "left by a killed API: removed"
        assert young.exists(), "possibly another replica's upload in progress: kept"
        assert other.exists(), "not an upload temp file: not ours to remove"

"""``python -m demo`` keeps its data where every ``zenflow`` command does (issue 27 item 5), and never
deletes it unless asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from demo import cli, folder


def test_demo_and_cli_share_the_data_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from api.cli.main import _settings
    from store.settings import get_settings

    monkeypatch.setenv("ZENFLOW_DATA_DIR", str(tmp_path / "shared"))
    monkeypatch.setenv("ZENFLOW_MAX_JOB_ATTEMPTS", "5")
    get_settings.cache_clear()
    try:
        cli_dir = _settings().data_dir.resolve()
    finally:
        get_settings.cache_clear()
    assert folder.data_folder() == cli_dir == (tmp_path / "shared").resolve()
    env = folder.service_env(folder.data_folder())
    assert env["ZENFLOW_DATA_DIR"] == str(cli_dir)
    assert env["ZENFLOW_MAX_JOB_ATTEMPTS"] == "5"  # the other settings reach the demo's server too
    # --data-dir still wins, made absolute; and with no ZENFLOW_DATA_DIR both use ./var
    assert folder.data_folder(Path("elsewhere")) == Path("elsewhere").resolve()
    monkeypatch.delenv("ZENFLOW_DATA_DIR")
    monkeypatch.chdir(tmp_path)
    get_settings.cache_clear()
    try:
        assert folder.data_folder() == _settings().data_dir.resolve() == (tmp_path / "var").resolve()
    finally:
        get_settings.cache_clear()


def test_demo_keeps_the_data_folder_unless_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A demo run never deletes the shared folder (keys made with ``zenflow keys create`` stay)."""
    seen: dict[str, object] = {}

    def fake_run(data_dir: Path, *, timeout: float, fresh: bool, stay: bool) -> int:
        seen.update(data_dir=data_dir, fresh=fresh)
        return 0

    monkeypatch.setattr(cli, "run", fake_run)
    monkeypatch.setenv("ZENFLOW_DATA_DIR", str(tmp_path / "d"))
    assert cli.main(["--no-stay"]) == 0
    assert seen == {"data_dir": (tmp_path / "d").resolve(), "fresh": False}
    assert cli.main(["--no-stay", "--keep"]) == 0 and seen["fresh"] is False
    assert cli.main(["--no-stay", "--fresh"]) == 0 and seen["fresh"] is True

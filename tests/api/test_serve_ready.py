"""``zenflow serve`` says it is ready only once it accepts connections, and ``python -m api.demo`` keeps
its data where every ``zenflow`` command does (issue 27 item 5)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from api import demo
from trainer.run.launch import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_serve_says_ready_only_when_it_accepts_connections(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZENFLOW_")}
    env["ZENFLOW_DATA_DIR"] = str(tmp_path / "var")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "api.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 180
        ready = None
        for line in proc.stdout:  # the log, line by line, until the ready line
            seen.append(line)
            if "ZenFlow API ready on" in line:
                ready = line
                break
            assert time.monotonic() < deadline, "".join(seen[-40:])
        assert ready is not None, "".join(seen[-40:])
        # Nothing before the ready line claims the URL (the old log said it before the app had started).
        assert not any(f":{port}" in line for line in seen[:-1] if "zenflow.serve" in line), "".join(seen)
        assert ready.rstrip().endswith(f"http://127.0.0.1:{port}")
        with socket.create_connection(("127.0.0.1", port), timeout=1):  # at once, no retry
            pass
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


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
    assert demo.data_folder() == cli_dir == (tmp_path / "shared").resolve()
    env = demo._env(demo.data_folder())
    assert env["ZENFLOW_DATA_DIR"] == str(cli_dir)
    assert env["ZENFLOW_MAX_JOB_ATTEMPTS"] == "5"  # the other settings reach the demo's server too
    # --data-dir still wins, made absolute; and with no ZENFLOW_DATA_DIR both use ./var
    assert demo.data_folder(Path("elsewhere")) == Path("elsewhere").resolve()
    monkeypatch.delenv("ZENFLOW_DATA_DIR")
    monkeypatch.chdir(tmp_path)
    get_settings.cache_clear()
    try:
        assert demo.data_folder() == _settings().data_dir.resolve() == (tmp_path / "var").resolve()
    finally:
        get_settings.cache_clear()


def test_demo_keeps_the_data_folder_unless_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A demo run never deletes the shared folder (keys made with ``zenflow keys create`` stay)."""
    seen: dict[str, object] = {}

    def fake_run(data_dir: Path, *, timeout: float, fresh: bool, stay: bool) -> int:
        seen.update(data_dir=data_dir, fresh=fresh)
        return 0

    monkeypatch.setattr(demo, "run", fake_run)
    monkeypatch.setenv("ZENFLOW_DATA_DIR", str(tmp_path / "d"))
    assert demo.main(["--no-stay"]) == 0
    assert seen == {"data_dir": (tmp_path / "d").resolve(), "fresh": False}
    assert demo.main(["--no-stay", "--keep"]) == 0 and seen["fresh"] is False
    assert demo.main(["--no-stay", "--fresh"]) == 0 and seen["fresh"] is True

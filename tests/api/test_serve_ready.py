"""``zenflow serve`` says it is ready only once it accepts connections (issue 27 item 5; the demo's data
folder, the same item's other half, is tests/demo/test_data_folder.py)."""

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

from trainer.run.launch import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.services
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
        where = next(proc.stdout)  # then where a person goes: the console and the API reference
        assert where.rstrip().endswith(
            f"console http://127.0.0.1:{port}/console/, API reference http://127.0.0.1:{port}/docs/"
        ), where
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

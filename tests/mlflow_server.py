"""A real ``mlflow server`` for the tracking tests: SQLite backend, a free loopback port."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.support import startup_seconds
from trainer.run.launch import free_port


@contextlib.contextmanager
def running_mlflow_server(folder: Path) -> Iterator[str]:
    """``mlflow server`` on a SQLite store in ``folder``; its URI once ``/health`` answers (the deadline
    from this machine's speed now: its start migrates a fresh database, ~40 s on a busy 2-core box)."""
    port = free_port()
    log = (folder / "server.log").open("wb")
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "mlflow"),
            "server",
            "--backend-store-uri",
            f"sqlite:///{folder / 'mlflow.db'}",
            "--default-artifact-root",
            str(folder / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + max(120.0, 60 * startup_seconds())
    try:
        while True:
            assert proc.poll() is None, (folder / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{uri}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (folder / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()

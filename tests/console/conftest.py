"""What the console's browser tests share: ``zenflow serve --worker`` on a private PostgreSQL database and
Redis queue (one for the session), headless Debian Chromium, and the page's problems as they come."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.console.harness import LiveServer
from tests.support import (
    REDIS_URL,
    create_database,
    drop_database,
    require_redis,
    stop_process_group,
    unavailable,
)
from trainer.run.launch import free_port

if TYPE_CHECKING:
    from playwright.sync_api import Browser

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="package")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """``zenflow serve --worker`` on a private PostgreSQL database and Redis queue."""
    import redis

    redis_url = require_redis(REDIS_URL)
    database_url = create_database("zf_console")
    queue = f"zf-test-console-{secrets.token_hex(4)}"
    data_dir = tmp_path_factory.mktemp("zf-console")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZENFLOW_")}
    env.update(
        ZENFLOW_DATABASE_URL=database_url,
        ZENFLOW_BROKER_URL=redis_url,
        ZENFLOW_DEFAULT_QUEUE=queue,
        ZENFLOW_DATA_DIR=str(data_dir / "var"),
        ZENFLOW_API_STREAM_POLL_SECONDS="0.1",
        PYTHONUNBUFFERED="1",
    )
    port = free_port()
    log = data_dir / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "api.cli.main",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--worker",
                "--no-reaper",
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        yield LiveServer(base, database_url, log)
    finally:
        stop_process_group(proc)
        drop_database(database_url)
        r = redis.Redis.from_url(redis_url)
        for key in r.scan_iter(f"*{queue}*"):
            r.delete(key)


@pytest.fixture(scope="package")
def browser() -> Iterator[Browser]:
    """Headless Debian Chromium (never Playwright's own download), for this package's tests only: Playwright's
    sync API keeps an event loop running on the main thread while it is open, and a later test's
    ``asyncio.run`` in the same process would fail under it."""
    if not CHROMIUM.exists():
        unavailable(
            f"Chromium is not installed at {CHROMIUM} (scripts/bootstrap.sh installs the Debian package)"
        )
    from playwright.sync_api import sync_playwright

    args = ["--no-sandbox"] if os.geteuid() == 0 else []  # Chromium's sandbox refuses to run as root
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=args)
        try:
            yield b
        finally:
            b.close()

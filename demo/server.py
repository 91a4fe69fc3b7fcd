"""``zenflow serve`` as the demo runs it: on a free loopback port, its log in the data folder."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from demo.folder import ROOT
from trainer.run.launch import free_port

_PR_SET_PDEATHSIG = 1


def _stop_with_parent(parent: int) -> Callable[[], None]:
    """What the server's process runs before its exec: SIGTERM (its clean stop: the job checkpointed and
    re-queued) when the demo dies, however it dies (its terminal closed, SIGKILL); it is in a session of
    its own, so the terminal's SIGHUP never reaches it, and nothing else would stop it."""

    def prepare() -> None:
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL("libc.so.6", use_errno=True).prctl(
                    _PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0
                )
        if os.getppid() != parent:  # the demo died before the line above took effect
            os._exit(1)

    return prepare


class Server:
    """A started ``zenflow serve`` (its own process group, stopped when the demo's process ends);
    :meth:`stop` ends it and closes its log."""

    def __init__(self, env: dict[str, str], data_dir: Path) -> None:
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = data_dir / "serve.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "api.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_stop_with_parent(os.getpid()),
        )

    def wait_ready(self, timeout: float) -> None:
        """Until ``/readyz`` answers 200; RuntimeError when the server exits or ``timeout`` passes."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"zenflow serve exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.base}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("zenflow serve did not become ready")

    def wait_for_interrupt(self) -> None:
        """Keep the server up (for the console) until Ctrl-C or until it exits by itself."""
        try:
            while self.proc.poll() is None:
                time.sleep(0.5)
        except KeyboardInterrupt:
            print()

    def stop(self) -> None:
        """SIGINT to the server's group (SIGKILL after 20 s), then its log closed."""
        proc = self.proc
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._log.close()

    def print_log_tail(self, lines: int = 40) -> None:
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        print("---- zenflow serve log (tail) ----", *tail, sep="\n", file=sys.stderr)

"""A TCP relay (tests/worker/tcp_relay.py) in a process of its own, for tests that freeze a service:
``SIGSTOP`` it and every connection through it (and every new one: the kernel still completes the
handshake) accepts bytes and never answers, as a frozen host or a stuck pooler does; ``SIGCONT`` and it
forwards again.

``python -m tests.tcp_proxy TARGET_HOST TARGET_PORT`` listens on a free port of that host and prints it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.worker.tcp_relay import TcpRelay

ROOT = Path(__file__).resolve().parents[1]


def start(target_host: str, target_port: int) -> tuple[subprocess.Popen[str], int]:
    """The relay's process and the port it listens on."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.tcp_proxy", target_host, str(target_port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def freeze(proc: subprocess.Popen[str]) -> None:
    """Stop the relay and return once it is stopped (a signal takes effect when the process is next
    scheduled: a query sent at once could still be relayed)."""
    os.kill(proc.pid, signal.SIGSTOP)
    stat = Path(f"/proc/{proc.pid}/stat")
    while stat.read_text().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
        time.sleep(0.01)


def thaw(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGCONT)


if __name__ == "__main__":
    relay = TcpRelay(int(sys.argv[2]), host=sys.argv[1])
    relay.open()
    print(relay.port, flush=True)
    threading.Event().wait()

"""A TCP proxy in its own process, for tests that freeze a service: ``SIGSTOP`` it and every connection
through it (and every new one: the kernel still completes the handshake) accepts bytes and never
answers, as a frozen host or a stuck pooler does; ``SIGCONT`` and it forwards again.

``python -m tests.tcp_proxy TARGET_HOST TARGET_PORT`` listens on a free loopback port and prints it.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def _serve(listener: socket.socket, target: tuple[str, int]) -> None:
    while True:
        client, _ = listener.accept()
        try:
            upstream = socket.create_connection(target, timeout=10)
        except OSError:
            client.close()
            continue
        upstream.settimeout(None)
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def start(target_host: str, target_port: int) -> tuple[subprocess.Popen[str], int]:
    """The proxy process and the port it listens on."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.tcp_proxy", target_host, str(target_port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


if __name__ == "__main__":
    with socket.create_server(("127.0.0.1", 0), backlog=128) as sock:
        print(sock.getsockname()[1], flush=True)
        _serve(sock, (sys.argv[1], int(sys.argv[2])))

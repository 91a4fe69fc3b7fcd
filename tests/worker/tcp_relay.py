"""A TCP relay on a port of its own to a target address, listening only once :meth:`open` is called:
a server that is "down" (nothing listens, connections are refused) and then "back", without stopping
or starting the real one."""

from __future__ import annotations

import contextlib
import socket
import threading

from trainer.run.launch import free_port


class TcpRelay:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.host, self.target_port = host, target_port
        self.port = free_port(host)
        self._server: socket.socket | None = None
        self._stop = threading.Event()

    @property
    def uri(self) -> str:
        return f"http://{self.host}:{self.port}"

    def open(self) -> None:
        srv = socket.create_server((self.host, self.port))
        srv.settimeout(0.2)
        self._server = srv
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.close()

    def _accept(self) -> None:
        assert self._server is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection((self.host, self.target_port))
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
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

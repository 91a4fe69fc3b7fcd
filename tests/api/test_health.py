"""/healthz, /readyz, and 503 (not 500) while the database is away, recovering when it returns."""

from __future__ import annotations

import contextlib
import socket
import threading

from fastapi.testclient import TestClient
from sqlalchemy.engine import make_url

from api.app import create_app
from store.settings import Settings
from tests.api.conftest import TEST_API_SETTINGS, error_of, make_team
from trainer.run.launch import free_port


def test_healthz_and_readyz(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    r = client.get("/readyz")
    assert r.status_code == 200, r.text
    assert r.json()["checks"]["database"]["status"] == "ok" and r.json()["checks"]["broker"]["status"] == "ok"


def test_readyz_reports_an_unreachable_broker(settings: Settings) -> None:
    bad = settings.model_copy(update={"broker_url": "redis://127.0.0.1:1/0"})
    with TestClient(create_app(bad, TEST_API_SETTINGS)) as c:
        r = c.get("/readyz")
    assert r.status_code == 503
    assert (
        r.json()["checks"]["broker"]["status"] == "unavailable"
        and r.json()["checks"]["database"]["status"] == "ok"
    )


class TcpProxy:
    """A loopback TCP proxy that can be cut and restored, to take the database away and back."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener: socket.socket | None = None
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.port = free_port()

    def start(self) -> None:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(16)
        self.listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        if self.listener is not None:
            with contextlib.suppress(OSError):
                self.listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            self.listener.close()
            self.listener = None
        with self.lock:
            for c in self.conns:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
                c.close()
            self.conns.clear()


def test_database_outage_is_503_then_recovers(settings: Settings) -> None:
    u = make_url(settings.database_url)
    proxy = TcpProxy(u.host or "127.0.0.1", u.port or 5432)
    proxy.start()
    via_proxy = settings.model_copy(
        update={
            "database_url": u.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        }
    )
    app = create_app(via_proxy, TEST_API_SETTINGS)
    try:
        with TestClient(app) as c:
            t = make_team(app)
            assert c.get("/v1/files", headers=t.headers).status_code == 200
            proxy.stop()
            for path in ("/v1/files", "/v1/fine_tuning/jobs"):
                r = c.get(path, headers=t.headers)
                assert r.status_code == 503, r.text
                err = error_of(r)
                assert err["code"] == "database_unavailable" and err["type"] == "server_error"
            assert c.get("/readyz").status_code == 503
            assert c.get("/healthz").status_code == 200
            proxy.start()
            assert c.get("/v1/files", headers=t.headers).status_code == 200
            assert c.get("/readyz").status_code == 200
    finally:
        proxy.stop()
        app.state.engine.dispose()


def test_prometheus_metrics_are_served(client: TestClient) -> None:
    import importlib.util

    if importlib.util.find_spec("api.core.prometheus") is None:
        return
    client.get("/healthz")
    r = client.get("/metrics")
    assert r.status_code == 200 and "http_request_duration_seconds" in r.text

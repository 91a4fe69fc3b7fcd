"""Bounded and well-answered requests: header limits (the app's 431 and uvicorn's h11 bound on a real
socket), the Content-Type of a JSON body, NUL bytes in ids (one 404 on PostgreSQL and SQLite), the
full Allow list of a 405, a model name with a segment longer than a filesystem's folder name (4xx on
every route that takes a model, never a 500), and a JSONL line nested 100,000 levels deep."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.core.config import ApiSettings
from api.server import uvicorn_command, uvicorn_options
from store.settings import Settings
from tests.api.conftest import (
    TEST_API_SETTINGS,
    Enqueued,
    TeamKey,
    chat_jsonl,
    error_of,
    make_team,
    upload,
    uploaded_id,
)
from trainer.run.launch import free_port

# --- Content-Type ------------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_json_body_without_json_content_type_says_so(
    client: TestClient, team: TeamKey, content_type: str | None
) -> None:
    headers = {**team.headers, **({"Content-Type": content_type} if content_type else {})}
    r = client.post(
        "/v1/fine_tuning/jobs", headers=headers, content=b'{"model": "tiny-llama", "training_file": "f"}'
    )
    assert r.status_code == 400
    err = error_of(r)
    assert err["code"] == "invalid_content_type" and err["param"] == "Content-Type"
    assert "application/json" in err["message"] and "dictionary" not in err["message"]
    assert (content_type or "no Content-Type") in err["message"]


def test_json_body_that_is_not_an_object(client: TestClient, team: TeamKey) -> None:
    r = client.post("/v1/fine_tuning/jobs", headers=team.headers, json=[1, 2])
    assert r.status_code == 400 and error_of(r)["message"] == "The request body must be a JSON object"
    r = client.post(
        "/v1/fine_tuning/jobs",
        headers={**team.headers, "Content-Type": "application/json; charset=utf-8"},
        content=b'{"model": "tiny-llama"}',
    )  # a parameter on the type is fine: the field is named
    assert r.status_code == 400 and error_of(r)["param"] == "training_file"


# --- NUL bytes in ids ------------------------------------------------------------------------------

ID_PATHS = [
    ("GET", "/v1/files/file-%00", "file_id"),
    ("GET", "/v1/files/file-%00abc/content", "file_id"),
    ("DELETE", "/v1/files/%00", "file_id"),
    ("GET", "/v1/fine_tuning/jobs/ftjob-%00", "fine_tuning_job_id"),
    ("POST", "/v1/fine_tuning/jobs/ftjob-%00/cancel", "fine_tuning_job_id"),
    ("GET", "/v1/fine_tuning/jobs/ftjob-%00/events", "fine_tuning_job_id"),
    ("GET", "/v1/fine_tuning/jobs/ftjob-%00/events?stream=true", "fine_tuning_job_id"),
    ("GET", "/v1/fine_tuning/jobs/ftjob-%00/checkpoints", "fine_tuning_job_id"),
    ("GET", "/v1/fine_tuning/jobs/ftjob-%00/metrics", "fine_tuning_job_id"),
]
QUERY_PATHS = [
    "/v1/files?after=file-%00",
    "/v1/fine_tuning/jobs?after=%00x",
    "/v1/fine_tuning/jobs/x/events?after=%00",
]


def _nul_answers(client: TestClient, team: TeamKey) -> list[tuple[int, dict[str, object]]]:
    out = []
    for method, path, _ in ID_PATHS:
        r = client.request(method, path, headers=team.headers)
        out.append((r.status_code, error_of(r)))
    for path in QUERY_PATHS:
        r = client.get(path, headers=team.headers)
        out.append((r.status_code, error_of(r)))
    return out


def test_nul_in_ids_is_404_on_postgresql_and_sqlite(
    client: TestClient, team: TeamKey, tmp_path: Path
) -> None:
    pg = _nul_answers(client, team)
    for (status, err), (_, path, param) in zip(pg, ID_PATHS, strict=False):
        assert status == 404, (path, err)
        assert err["code"] == "not_found" and err["param"] == param, (path, err)
        assert "\\x00" in str(err["message"]) and "\x00" not in str(err["message"])
    for status, err in pg[len(ID_PATHS) :]:
        assert status == 400 and err["param"] == "after" and "NUL" in str(err["message"]), err
    # Without a key: 401 first, as for any id.
    assert client.get("/v1/files/file-%00").status_code == 401

    from api.app import create_app

    sqlite_settings = Settings(_env_file=None, data_dir=tmp_path / "var")  # type: ignore[call-arg]
    app = create_app(sqlite_settings, ApiSettings(_env_file=None), enqueue=Enqueued())  # type: ignore[call-arg]
    with TestClient(app) as c:
        assert _nul_answers(c, make_team(app)) == pg


# --- over-long model names ----------------------------------------------------------------------------

LONG_NAME = "m" * 300  # past NAME_MAX: once an OSError (File name too long) under a model root, a 500


@pytest.fixture(scope="module")
def rooted_client(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """An app with a model root, so that a name is looked up as a folder under it."""
    from api.app import create_app

    rooted = settings.model_copy(update={"model_roots": [tmp_path_factory.mktemp("roots")]})
    with TestClient(create_app(rooted, TEST_API_SETTINGS, enqueue=Enqueued())) as c:
        yield c


def _long_name_answers(c: TestClient, team: TeamKey) -> dict[str, Any]:
    file_id = uploaded_id(c, team)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    h = team.headers
    return {
        "chat": c.post("/v1/chat/completions", headers=h, json={"model": LONG_NAME, **chat}),
        "completions": c.post("/v1/completions", headers=h, json={"model": LONG_NAME, "prompt": "hi"}),
        "job create": c.post(
            "/v1/fine_tuning/jobs", headers=h, json={"model": LONG_NAME, "training_file": file_id}
        ),
        "GET model": c.get(f"/v1/models/{LONG_NAME}", headers=h),
        "DELETE model": c.delete(f"/v1/models/{LONG_NAME}", headers=h),
        "GET content": c.get(f"/v1/models/{LONG_NAME}/content", headers=h),
        "HEAD content": c.head(f"/v1/models/{LONG_NAME}/content", headers=h),
        "file preview": c.get(f"/v1/files/{file_id}/preview", headers=h, params={"model": LONG_NAME}),
        "upload": c.post(
            "/v1/files",
            headers=h,
            data={"purpose": "fine-tune", "model": LONG_NAME},
            files={"file": ("train.jsonl", chat_jsonl(), "application/jsonl")},
        ),
    }


def test_a_model_name_segment_past_name_max_is_not_found_on_every_route(
    rooted_client: TestClient, app: FastAPI
) -> None:
    answers = _long_name_answers(rooted_client, make_team(app))
    for route, r in answers.items():
        assert r.status_code in (400, 404), (route, r.status_code, r.text[:300])
        if r.request.method != "HEAD":
            err = error_of(r)
            assert err["param"] in ("model", None) and "File name too long" not in str(err["message"]), route
    models = ("GET model", "DELETE model", "GET content", "HEAD content", "chat", "completions")
    assert {route: answers[route].status_code for route in models} == dict.fromkeys(models, 404)


# --- Allow --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, allow",
    [
        ("/v1/files/file-abc", "DELETE, GET"),
        ("/v1/files", "GET, POST"),
        ("/v1/fine_tuning/jobs", "GET, POST"),
        ("/v1/fine_tuning/jobs/ftjob-1/cancel", "POST"),
        ("/healthz", "GET"),
    ],
)
def test_405_allow_lists_every_method_of_the_path(
    client: TestClient, team: TeamKey, path: str, allow: str
) -> None:
    for method in ("OPTIONS", "PUT", "PATCH"):
        r = client.request(method, path, headers=team.headers)
        assert r.status_code == 405, (method, path)
        assert r.headers["allow"] == allow
        err = error_of(r)
        assert err["code"] == "method_not_allowed" and allow in str(err["message"])


# --- header limits -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited_client(settings: Settings) -> Iterator[TestClient]:
    from api.app import create_app

    api_settings = TEST_API_SETTINGS.model_copy(update={"max_header_count": 20, "max_header_bytes": 4096})
    with TestClient(create_app(settings, api_settings, enqueue=Enqueued())) as c:
        yield c


def test_too_many_or_too_large_headers_are_431(limited_client: TestClient) -> None:
    assert limited_client.get("/healthz", headers={f"x-h{i}": "1" for i in range(10)}).status_code == 200
    r = limited_client.get("/healthz", headers={f"x-h{i}": "1" for i in range(30)})
    assert r.status_code == 431 and error_of(r)["code"] == "request_header_too_large"
    assert "limit of 20" in error_of(r)["message"]
    r = limited_client.get("/v1/files", headers={"x-big": "a" * 5000})
    assert r.status_code == 431 and "limit of 4096" in error_of(r)["message"]


class _H11Server:
    """The app under uvicorn with the production options (api.server.uvicorn_options), in a thread."""

    def __init__(self, app: FastAPI, api_settings: ApiSettings) -> None:
        self.port = free_port()
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="error",
            lifespan="off",
            **uvicorn_options(api_settings),
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> _H11Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)

    def raw(self, head: bytes, *, filler: int = 0) -> tuple[bytes, int]:
        """Send ``head`` then up to ``filler`` bytes of one header's value; the answer and how many
        filler bytes the server took before it answered and closed."""
        sent = 0
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
            s.sendall(head)
            chunk = b"a" * 65536
            try:
                while sent < filler:
                    s.sendall(chunk)
                    sent += len(chunk)
                if not filler:
                    s.shutdown(socket.SHUT_WR)
            except (BrokenPipeError, ConnectionResetError):
                pass
            data = b""
            try:
                while part := s.recv(65536):
                    data += part
            except ConnectionResetError:
                pass
        return data, sent


def test_uvicorn_h11_stops_reading_a_huge_header(app: FastAPI) -> None:
    api_settings = TEST_API_SETTINGS.model_copy(update={"max_header_bytes": 16 * 1024})
    with _H11Server(app, api_settings) as srv:
        ok, _ = srv.raw(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200")
        answer, taken = srv.raw(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ", filler=64 * 1024 * 1024)
        assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
        # It stopped at the limit: far less than the 64 MiB offered went in (socket buffers aside).
        assert taken < 16 * 1024 * 1024, taken
        again, _ = srv.raw(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert again.startswith(b"HTTP/1.1 200")


def test_uvicorn_command_carries_the_limits() -> None:
    from uvicorn.main import main as uvicorn_cli

    argv = uvicorn_command(8123)
    assert argv[1:3] == ["-m", "uvicorn"]
    ctx = uvicorn_cli.make_context("uvicorn", argv[3:])  # parsed as uvicorn's own CLI parses it
    opts = uvicorn_options()
    assert ctx.params["http"] == "h11" == opts["http"]
    assert ctx.params["h11_max_incomplete_event_size"] == opts["h11_max_incomplete_event_size"] == 16 * 1024
    assert ctx.params["timeout_keep_alive"] == opts["timeout_keep_alive"]


# --- deeply nested JSONL ---------------------------------------------------------------------------


def test_deeply_nested_jsonl_line_is_400_naming_the_line(
    client: TestClient, team: TeamKey, settings: Settings
) -> None:
    good = b'{"prompt": "1+1=", "completion": "2"}\n'
    content = good + b"[" * 100_000 + b"]" * 100_000 + b"\n" + good
    r = upload(client, team, content)
    assert r.status_code == 400, r.text[:300]
    err = error_of(r)
    assert err["code"] == "invalid_file_format" and "line 2" in str(err["message"])
    assert "nested too deeply" in str(err["message"])
    assert [e["line"] for e in r.json()["error"]["errors"]] == [2]
    assert uploaded_id(client, team, good * 2)  # the server is fine

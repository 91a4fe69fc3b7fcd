"""The data check at create and at upload with ``model`` (api.jobs.data_check, api.jobs.check_pool;
issue 25): in check processes, not in the database threads, so another team's reads stay answered
while heavy checks run; a create whose client left, or whose check ran past its budget, or that a
SIGTERM interrupts, creates no job; a create after an upload checked with the same model and options
does not check again; a lone surrogate, a 5000-digit integer and an example over the server's bounds
are 400s naming the line, at upload and at create."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select

from api.jobs import data_check
from api.jobs.check_pool import CheckPool
from api.server import uvicorn_command
from store.orm import File
from store.settings import Settings
from tests.api.conftest import (
    TEST_API_SETTINGS,
    Enqueued,
    ServerThread,
    TeamKey,
    error_of,
    make_team,
    team_rows,
)
from tests.model_folders import write_model_folder
from trainer.run.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
JOBS = "/v1/fine_tuning/jobs"
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
#: A template that spends about as long on each message as a real one on a long message: a line of it
#: costs tens of milliseconds to check, so a file of a few thousand lines keeps a check busy.
SLOW_TEMPLATE = (
    "{% for m in messages %}{% for _ in range(200) %}{% for _ in range(1000) %}{% endfor %}{% endfor %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: How long a stopped check may take to be seen stopped: the processes stop between two lines.
STOP_WAIT_SECONDS = 60.0
#: At most this many lines in a slow file (about 90 bytes each, under the apps' upload limit).
MAX_LINES = 100_000


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("roots")
    write_model_folder(root / "qwen2-tiny", "qwen2", max_position_embeddings=1024)
    write_model_folder(root / "slow-tiny", "qwen2", max_position_embeddings=1024, chat_template=SLOW_TEMPLATE)
    return root


@pytest.fixture(scope="module")
def slow_lines(roots: Path, tmp_path_factory: pytest.TempPathFactory) -> int:
    """Lines of a file whose check with slow-tiny takes about 4 x STOP_WAIT_SECONDS (measured here)."""
    from trainer.data.dataset import validate_file
    from trainer.model.catalog import load_tokenizer

    path = tmp_path_factory.mktemp("probe") / "probe.jsonl"
    path.write_text((json.dumps(CHAT) + "\n") * 10)
    tok = load_tokenizer(str(roots / "slow-tiny"))
    validate_file(path, tokenizer=tok, max_seq_length=256)  # the template compiled
    t = time.perf_counter()
    validate_file(path, tokenizer=tok, max_seq_length=256)
    per_line = (time.perf_counter() - t) / 10
    return min(MAX_LINES, max(200, math.ceil(4 * STOP_WAIT_SECONDS / per_line)))


def _app(settings: Settings, roots: Path, **update: Any) -> FastAPI:
    from api.app import create_app

    return create_app(
        settings.model_copy(update={"model_roots": [roots], "max_upload_bytes": 16 * 1024**2, **update}),
        TEST_API_SETTINGS,
        enqueue=Enqueued(),
    )


@pytest.fixture(scope="module")
def capp(settings: Settings, roots: Path) -> FastAPI:
    return _app(settings, roots)


@pytest.fixture(scope="module")
def cclient(capp: FastAPI) -> Iterator[TestClient]:
    with TestClient(capp) as c:
        yield c


@pytest.fixture
def cteam(capp: FastAPI) -> TeamKey:
    return make_team(capp)


def body_of(records: list[Any]) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode()


def upload(client: Any, team: TeamKey, body: bytes, **fields: str) -> Any:
    return client.post(
        "/v1/files",
        headers=team.headers,
        data={"purpose": "fine-tune", **fields},
        files={"file": ("train.jsonl", body, "application/jsonl")},
    )


def file_id(client: Any, team: TeamKey, body: bytes, **fields: str) -> str:
    r = upload(client, team, body, **fields)
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def pool(app: FastAPI) -> CheckPool:
    p: CheckPool = app.state.data_checks
    return p


@contextmanager
def settings_of(app: FastAPI, **update: Any) -> Iterator[None]:
    before = app.state.settings
    app.state.settings = before.model_copy(update=update)
    try:
        yield
    finally:
        app.state.settings = before


def rewrite_stored(app: FastAPI, fid: str, body: bytes) -> None:
    """Replace a stored file's bytes (as a file stored before this server checked what it checks)."""
    with app.state.sessionmaker() as s:
        row = s.get(File, fid)
        assert row is not None
        Path(row.storage_path).write_bytes(body)


def wait_until(what: str, cond: Any, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"not {what} after {seconds:g} s"
        time.sleep(0.05)


SURROGATE = (
    '{"messages": [{"role": "user", "content": "a \\ud800 b"}, {"role": "assistant", "content": "x"}]}'
)
LONG_INT = (
    '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "weight": %s}]}'
    % ("9" * 5000)
)


@pytest.mark.parametrize(
    ("line", "field", "words"),
    [
        (SURROGATE, "messages[0].content", "unpaired UTF-16 surrogate"),
        (LONG_INT, "messages[1].weight", "5000 digits"),
    ],
)
def test_surrogates_and_long_integers_are_400s_naming_the_line(
    cclient: TestClient, capp: FastAPI, cteam: TeamKey, line: str, field: str, words: str
) -> None:
    for fields in ({}, {"model": "qwen2-tiny"}):
        r = upload(cclient, cteam, body_of([CHAT, line]), **fields)
        assert r.status_code == 400, r.text
        err = error_of(r)
        assert (err["param"], err["code"], err["field"]) == ("file", "invalid_file_format", field)
        assert err["errors"][0]["line"] == 2 and words in err["message"]
        assert f"line 2: {field}: " in err["message"] and "set_int_max_str_digits" not in err["message"]
    fid = file_id(cclient, cteam, body_of([CHAT, CHAT]))
    rewrite_stored(capp, fid, body_of([CHAT, line]))
    r = cclient.post(JOBS, headers=cteam.headers, json={"model": "qwen2-tiny", "training_file": fid})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert (err["param"], err["code"], err["field"]) == ("training_file", "invalid_training_file", field)
    assert f"line 2: {field}: " in err["message"] and words in err["message"]
    assert team_rows(capp, cteam) == (0, 0)


def test_the_bounds_of_one_example_are_400s_naming_the_line(
    cclient: TestClient, capp: FastAPI, cteam: TeamKey
) -> None:
    many = {"messages": [{"role": ["user", "assistant"][i % 2], "content": "a"} for i in range(6)]}
    long = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * 300}]}
    with settings_of(capp, max_example_messages=4):  # no tokenizer needed: refused at any upload
        r = upload(cclient, cteam, body_of([CHAT, many]))
        err = error_of(r)
        assert r.status_code == 400 and (err["field"], err["errors"][0]["line"]) == ("messages", 2)
        assert "6 messages, over this server's limit of 4 per example" in err["message"]
    with settings_of(capp, max_example_tokens=100):  # tokens: with a model
        r = upload(cclient, cteam, body_of([CHAT, CHAT, long]), model="qwen2-tiny")
        err = error_of(r)
        assert r.status_code == 400 and (err["code"], err["errors"][0]["line"]) == ("invalid_file_format", 3)
        assert "tokens, over this server's limit of 100" in err["message"]
    fid = file_id(cclient, cteam, body_of([CHAT, many, long]))  # stored under the default bounds
    with settings_of(capp, max_example_messages=4, max_example_tokens=100):  # then lowered
        r = cclient.post(JOBS, headers=cteam.headers, json={"model": "qwen2-tiny", "training_file": fid})
    err = error_of(r)
    assert r.status_code == 400 and err["code"] == "invalid_training_file"
    assert [(e["line"], e["field"]) for e in err["errors"]] == [(2, "messages"), (3, "messages")]
    assert team_rows(capp, cteam) == (0, 0)


def test_a_create_reuses_the_check_of_its_upload(cclient: TestClient, capp: FastAPI, cteam: TeamKey) -> None:
    checks = pool(capp)
    before = checks.submitted
    fid = file_id(cclient, cteam, body_of([CHAT] * 3), model="qwen2-tiny", max_seq_length="512")
    assert checks.submitted == before + 1
    body = {"model": "qwen2-tiny", "training_file": fid, "hyperparameters": {"max_seq_length": 512}}
    r = cclient.post(JOBS, headers=cteam.headers, json=body)
    assert r.status_code == 200, r.text
    assert checks.submitted == before + 1  # the upload's outcome, kept on the file's row
    other = {**body, "hyperparameters": {"max_seq_length": 256}}  # other options: checked once more ...
    assert cclient.post(JOBS, headers=cteam.headers, json=other).status_code == 200
    assert checks.submitted == before + 2
    assert cclient.post(JOBS, headers=cteam.headers, json=other).status_code == 200  # ... and kept
    assert checks.submitted == before + 2
    with capp.state.sessionmaker() as s:
        kept = s.scalar(select(File.data_checks).where(File.id == fid)) or {}
    assert len(kept) == 3 and data_check.UPLOAD_KEY in kept  # two checks with the model, the upload's own
    assert cclient.get(f"/v1/files/{fid}", headers=cteam.headers).json()["format"] == "chat"
    assert team_rows(capp, cteam)[0] == 3


def test_a_check_past_its_budget_creates_no_job(
    cclient: TestClient, capp: FastAPI, cteam: TeamKey, slow_lines: int
) -> None:
    fid = file_id(cclient, cteam, body_of([CHAT] * slow_lines))
    with settings_of(capp, data_check_timeout_seconds=1.0):
        r = cclient.post(JOBS, headers=cteam.headers, json={"model": "slow-tiny", "training_file": fid})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert (err["param"], err["code"]) == ("training_file", "data_check_timeout")
    assert "upload it with `model`" in err["message"] and "split it" in err["message"]
    assert team_rows(capp, cteam) == (0, 0)
    wait_until("stopped", lambda: pool(capp).running == 0, STOP_WAIT_SECONDS)


def raw_create(port: int, team: TeamKey, body: dict[str, Any]) -> socket.socket:
    """A create sent on a socket of its own, its answer not read (closing the socket = the client gone)."""
    data = json.dumps(body).encode()
    head = (
        f"POST {JOBS} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {team.key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(head.encode() + data)
    return sock


@pytest.fixture(scope="module")
def served(settings: Settings, roots: Path) -> Iterator[tuple[FastAPI, ServerThread]]:
    app = _app(settings, roots)
    with ServerThread(app) as server:
        yield app, server


def test_reads_stay_answered_while_heavy_checks_run_and_gone_clients_get_no_job(
    served: tuple[FastAPI, ServerThread], slow_lines: int
) -> None:
    app, server = served
    heavy, reader = make_team(app), make_team(app)
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        files = [file_id(c, heavy, body_of([CHAT] * slow_lines)) for _ in range(3)]
        socks = [raw_create(server.port, heavy, {"model": "slow-tiny", "training_file": f}) for f in files]
        try:
            wait_until("checking", lambda: pool(app).running > 0, STOP_WAIT_SECONDS)
            for _ in range(3):
                r = c.get(JOBS, headers=reader.headers)
                assert r.status_code == 200 and r.json()["data"] == []
            assert pool(app).running > 0  # answered while a check ran, not after it
            abandoned = pool(app).outcomes["abandoned"]
        finally:
            for s in socks:
                s.close()
    wait_until("stopped", lambda: pool(app).running == 0, STOP_WAIT_SECONDS)
    assert pool(app).outcomes["abandoned"] > abandoned  # stopped, not finished
    assert pool(app).outcomes["ok"] == 0  # no check passed: no create of theirs can make a job
    assert team_rows(app, heavy) == (0, 0)


def _descendants(pid: int) -> list[str]:
    """Command lines of a process's descendants (Linux /proc)."""
    out: list[str] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            for k in kids:
                todo.append(k)
                with suppress(OSError):
                    out.append(Path(f"/proc/{k}/cmdline").read_bytes().replace(b"\0", b" ").decode())
    return out


def test_sigterm_is_not_held_by_a_running_check(
    settings: Settings, roots: Path, app: FastAPI, tmp_path: Path, slow_lines: int
) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZENFLOW_")}
    env.update(
        ZENFLOW_DATABASE_URL=settings.database_url,
        ZENFLOW_DATA_DIR=str(tmp_path / "var"),
        ZENFLOW_MODEL_ROOTS=str(roots),
        ZENFLOW_API_MIGRATE_ON_START="false",
        PYTHONPATH=str(ROOT),
    )
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen(uvicorn_command(port), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until("serving", lambda: _up(url, proc), 120)
        team = make_team(app)  # the same database
        with httpx.Client(base_url=url, timeout=60) as c:
            fid = file_id(c, team, body_of([CHAT] * slow_lines))
        sock = raw_create(port, team, {"model": "slow-tiny", "training_file": fid})
        wait_until("checking", lambda: any("forkserver" in c for c in _descendants(proc.pid)), 120)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=STOP_WAIT_SECONDS)  # the check would run for 4x as long
        answer = _read_all(sock)
        assert answer.startswith("HTTP/1.1 503"), answer[:300]
        assert "server_shutting_down" in answer
        assert team_rows(app, team) == (0, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert proc.returncode in (0, -signal.SIGTERM), (tmp_path / "server.log").read_text()[-3000:]


def _read_all(sock: socket.socket) -> str:
    """What the server sent before it closed the connection (it has exited: nothing more comes)."""
    sock.settimeout(10)
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    sock.close()
    return b"".join(chunks).decode(errors="replace")


def _up(url: str, proc: subprocess.Popen[bytes]) -> bool:
    assert proc.poll() is None, f"server exited with {proc.returncode}"
    try:
        return httpx.get(url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False

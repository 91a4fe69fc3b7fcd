"""/v1/files: upload with validation, size limit and checksum; list, retrieve, content, delete."""

from __future__ import annotations

import hashlib
import json

from fastapi.testclient import TestClient
from sqlalchemy import func, select

from store.orm import File
from store.settings import Settings
from tests.api.conftest import TeamKey, chat_jsonl, error_of, stored_files, upload, uploaded_id


def _file_rows(app, team: TeamKey) -> int:  # type: ignore[no-untyped-def]
    with app.state.sessionmaker() as s:
        return s.scalar(select(func.count()).select_from(File).where(File.team_id == team.id))


def test_upload_retrieve_content(client: TestClient, team: TeamKey) -> None:
    content = chat_jsonl(5)
    r = upload(client, team, content, filename="../../etc/train.jsonl")
    assert r.status_code == 200, r.text
    f = r.json()
    assert f["object"] == "file" and f["purpose"] == "fine-tune" and f["status"] == "processed"
    assert f["id"].startswith("file-") and f["bytes"] == len(content) and isinstance(f["created_at"], int)
    assert f["filename"] == "train.jsonl"  # path components stripped
    assert f["sha256"] == hashlib.sha256(content).hexdigest() and f["num_examples"] == 5
    assert f["format"] == "chat"  # what the upload's check found (a client picks files by method with it)

    assert client.get(f"/v1/files/{f['id']}", headers=team.headers).json() == f
    c = client.get(f"/v1/files/{f['id']}/content", headers=team.headers)
    assert c.status_code == 200 and c.content == content


def test_a_files_format_is_what_its_records_are(client: TestClient, team: TeamKey) -> None:
    rows = {
        "prompt_completion": {"prompt": "Q", "completion": "A"},
        "preference": {
            "input": {"messages": [{"role": "user", "content": "Q"}]},
            "preferred_output": [{"role": "assistant", "content": "yes"}],
            "non_preferred_output": [{"role": "assistant", "content": "no"}],
        },
        "reinforcement": {"messages": [{"role": "user", "content": "Q"}], "keyword": "x"},
    }
    for fmt, row in rows.items():
        r = upload(client, team, (json.dumps(row) + "\n").encode() * 3)
        assert r.status_code == 200, r.text
        assert r.json()["format"] == fmt
        listed = client.get("/v1/files", headers=team.headers).json()["data"][0]
        assert (listed["id"], listed["format"]) == (r.json()["id"], fmt)


def test_list_paginates_newest_first(client: TestClient, team: TeamKey) -> None:
    ids = [uploaded_id(client, team) for _ in range(3)]
    page1 = client.get("/v1/files", params={"limit": 2}, headers=team.headers).json()
    assert page1["object"] == "list" and page1["has_more"] is True
    assert [f["id"] for f in page1["data"]] == ids[::-1][:2]
    assert page1["first_id"] == ids[2] and page1["last_id"] == ids[1]
    page2 = client.get(
        "/v1/files", params={"limit": 2, "after": page1["last_id"]}, headers=team.headers
    ).json()
    assert [f["id"] for f in page2["data"]] == [ids[0]] and page2["has_more"] is False
    asc = client.get("/v1/files", params={"order": "asc"}, headers=team.headers).json()
    assert [f["id"] for f in asc["data"]] == ids
    assert client.get("/v1/files", params={"purpose": "batch"}, headers=team.headers).json()["data"] == []


def test_delete_removes_row_and_bytes(client: TestClient, team: TeamKey, settings: Settings) -> None:
    fid = uploaded_id(client, team)
    assert any(fid in p.name for p in stored_files(settings))
    r = client.delete(f"/v1/files/{fid}", headers=team.headers)
    assert r.status_code == 200 and r.json() == {"id": fid, "object": "file", "deleted": True}
    assert not any(fid in p.name for p in stored_files(settings))
    assert client.get(f"/v1/files/{fid}", headers=team.headers).status_code == 404
    assert client.delete(f"/v1/files/{fid}", headers=team.headers).status_code == 404


def test_bad_jsonl_names_line_and_field_and_writes_nothing(
    client: TestClient, app, team: TeamKey, settings: Settings
) -> None:
    before = stored_files(settings)
    bad = chat_jsonl(2) + b'{"messages": [{"role": "bot", "content": "hi"}]}\n'
    r = upload(client, team, bad)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "file" and err["code"] == "invalid_file_format"
    assert "line 3" in err["message"] and "messages[0].role" in err["message"]
    assert err["errors"][0]["line"] == 3 and err["errors"][0]["field"] == "messages[0].role"
    assert _file_rows(app, team) == 0 and stored_files(settings) == before

    r = upload(client, team, b"not json at all\n")
    assert r.status_code == 400 and "line 1" in error_of(r)["message"]
    r = upload(client, team, b"")
    assert r.status_code == 400 and error_of(r)["param"] == "file"
    assert _file_rows(app, team) == 0 and stored_files(settings) == before


def test_oversized_upload_is_413_and_writes_nothing(
    client: TestClient, app, team: TeamKey, settings: Settings
) -> None:
    before = stored_files(settings)
    big = chat_jsonl(1) * (settings.max_upload_bytes // len(chat_jsonl(1)) + 10)
    r = upload(client, team, big)
    assert r.status_code == 413, r.text
    err = error_of(r)
    assert err["param"] == "file" and err["code"] == "file_too_large"
    # The Content-Length pre-check refuses a huge body without reading it.
    huge = chat_jsonl(1) * (4 * settings.max_upload_bytes // len(chat_jsonl(1)) + 4 * 1024 * 1024 // 200)
    assert upload(client, team, huge).status_code == 413
    assert _file_rows(app, team) == 0 and stored_files(settings) == before


def test_bad_form_fields(client: TestClient, team: TeamKey) -> None:
    r = upload(client, team, purpose=None)
    assert r.status_code == 400 and error_of(r)["param"] == "purpose"
    r = upload(client, team, purpose="assistants")
    assert r.status_code == 400 and error_of(r)["param"] == "purpose"
    r = client.post("/v1/files", headers=team.headers, files={"purpose": (None, "fine-tune")})
    assert r.status_code == 400 and error_of(r)["param"] == "file"
    r = client.post("/v1/files", headers=team.headers, data={"purpose": "fine-tune"})  # urlencoded
    assert r.status_code == 415 and error_of(r)["param"] == "file"
    r = client.post("/v1/files", headers={**team.headers, "Content-Type": "application/json"}, content=b"{}")
    assert r.status_code == 415 and error_of(r)["param"] == "file"
    r = client.post(
        "/v1/files",
        headers={**team.headers, "Content-Type": "multipart/form-data; boundary=xx"},
        content=b"garbage",
    )
    assert r.status_code == 400
    # a file name longer than a multipart header line may be: said so, not "malformed"
    r = client.post(
        "/v1/files",
        headers=team.headers,
        files={"file": ("n" * 5000 + ".jsonl", chat_jsonl(), "application/jsonl")},
        data={"purpose": "fine-tune"},
    )
    assert r.status_code == 400 and error_of(r)["param"] == "file", r.text
    assert "shorter file name" in error_of(r)["message"], r.text


def test_file_in_use_cannot_be_deleted(client: TestClient, team: TeamKey) -> None:
    fid = uploaded_id(client, team)
    r = client.post(
        "/v1/fine_tuning/jobs", headers=team.headers, json={"model": "tiny-llama", "training_file": fid}
    )
    assert r.status_code == 200, r.text
    r = client.delete(f"/v1/files/{fid}", headers=team.headers)
    assert r.status_code == 409 and error_of(r)["code"] == "file_in_use"
    assert r.headers["x-should-retry"] == "false"

"""API keys (hashed at rest), the 401 shape, team isolation, and the teams/keys CLI."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from api.core.auth import hash_key
from store.orm import ApiKey
from tests.api.conftest import TeamKey, error_of, uploaded_id

JOBS = "/v1/fine_tuning/jobs"


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer zf-wrongwrongwrongwrongwrong"},
        {"Authorization": "Basic abc"},
        {"Authorization": "Bearer "},
        {"Authorization": "Bearer sk-openai-style-key"},
    ],
)
def test_missing_or_wrong_key_is_401(client: TestClient, headers: dict[str, str]) -> None:
    for method, path in (
        ("GET", "/v1/files"),
        ("GET", JOBS),
        ("POST", JOBS),
        ("GET", f"{JOBS}/ftjob-x/events"),
    ):
        r = client.request(method, path, headers=headers)
        assert r.status_code == 401, (method, path, r.text)
        err = error_of(r)
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"


def test_key_is_stored_hashed_and_revocable(client: TestClient, app, team: TeamKey) -> None:  # type: ignore[no-untyped-def]
    from api.core.auth import revoke_key

    with app.state.sessionmaker() as s:
        row = s.scalar(select(ApiKey).where(ApiKey.team_id == team.id))
        assert row.key_hash == hash_key(team.key) and team.key not in (row.key_hash, row.prefix)
        assert team.key.startswith(row.prefix)
    assert client.get("/v1/files", headers=team.headers).status_code == 200
    with app.state.sessionmaker() as s:
        assert s.get(ApiKey, row.id).last_used_at is not None
        revoke_key(s, row.id)
        s.commit()
    assert client.get("/v1/files", headers=team.headers).status_code == 401


def test_team_isolation(client: TestClient, team: TeamKey, other_team: TeamKey) -> None:
    fid = uploaded_id(client, team)
    jid = client.post(JOBS, headers=team.headers, json={"model": "tiny-llama", "training_file": fid}).json()[
        "id"
    ]
    h = other_team.headers
    for method, path in [
        ("GET", f"/v1/files/{fid}"),
        ("GET", f"/v1/files/{fid}/content"),
        ("DELETE", f"/v1/files/{fid}"),
        ("GET", f"{JOBS}/{jid}"),
        ("POST", f"{JOBS}/{jid}/cancel"),
        ("GET", f"{JOBS}/{jid}/events"),
        ("GET", f"{JOBS}/{jid}/events?stream=true"),
        ("GET", f"{JOBS}/{jid}/checkpoints"),
        ("GET", f"{JOBS}/{jid}/metrics"),
        ("GET", f"/v1/files?after={fid}"),
        ("GET", f"{JOBS}?after={jid}"),
    ]:
        r = client.request(method, path, headers=h)
        assert r.status_code == 404, (method, path, r.text)
        assert error_of(r)["code"] == "not_found"
    assert client.get("/v1/files", headers=h).json()["data"] == []
    assert client.get(JOBS, headers=h).json()["data"] == []
    # Nothing changed for the owner.
    assert client.get(f"{JOBS}/{jid}", headers=team.headers).json()["status"] == "queued"
    assert client.get(f"/v1/files/{fid}", headers=team.headers).status_code == 200


def test_unknown_route_and_method_use_the_error_shape(client: TestClient, team: TeamKey) -> None:
    r = client.get("/v1/nothing-here", headers=team.headers)
    assert r.status_code == 404 and error_of(r)["type"] == "invalid_request_error"
    r = client.put(JOBS, headers=team.headers)
    assert r.status_code == 405 and error_of(r)["code"] == "method_not_allowed"


def test_cli_teams_and_keys(
    client: TestClient,
    settings,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
    capsys: pytest.CaptureFixture[str],
) -> None:
    import secrets

    from api.cli.main import main
    from store.settings import get_settings

    monkeypatch.setenv("ZENFLOW_DATABASE_URL", settings.database_url)
    monkeypatch.setenv("ZENFLOW_DATA_DIR", str(settings.data_dir))
    get_settings.cache_clear()
    try:
        name = f"cli-{secrets.token_hex(3)}"
        assert main(["teams", "create", name]) == 0
        assert main(["teams", "create", name]) == 1  # exists
        assert main(["keys", "create", "--team", "nope-" + name]) == 1
        capsys.readouterr()
        assert main(["keys", "create", "--team", name, "--name", "ci", "-q"]) == 0
        key = capsys.readouterr().out.strip()
        assert key.startswith("zf-")
        r = client.get("/v1/files", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200
        assert main(["keys", "list", "--team", name]) == 0
        assert "active" in capsys.readouterr().out
        assert main(["keys", "revoke", key[:11]]) == 0
        assert client.get("/v1/files", headers={"Authorization": f"Bearer {key}"}).status_code == 401
    finally:
        get_settings.cache_clear()


def test_cli_has_every_command() -> None:
    from api.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert {"serve", "db", "teams", "keys", "train"} <= set(sub.choices)  # type: ignore[union-attr]

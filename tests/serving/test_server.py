"""The serving process's app (``serving.server``) in process: only calls bearing the token are served,
a bad body is a 400 naming the client's field, the engine's refusals keep their status, envelope and
``Retry-After`` on the way back (``ServingError.from_body``, what ``serving.remote`` raises), and
``python -m serving`` will not start without a token."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from serving.config import ServingSettings, get_serving_settings
from serving.errors import ServingError
from serving.server import create_app

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
URL = "/internal/v1/chat/completions"


def _call(**request: object) -> dict[str, object]:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], **request}
    return {"team": "team-a", "model": {"id": "tiny-llama", "source": "tiny-llama"}, "request": body}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    settings = ServingSettings(_env_file=None, inference_server_token=TOKEN, inference_max_tokens=64)  # type: ignore[call-arg]
    with TestClient(create_app(settings)) as c:
        yield c


def test_only_the_token_is_served(client: TestClient) -> None:
    for headers in ({}, {"Authorization": "Bearer t0ke"}, {"Authorization": TOKEN + "x"}):
        r = client.post(URL, json=_call(max_tokens=2), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = client.post(URL, json=_call(max_tokens=2, temperature=0), headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion" and r.json()["usage"]["completion_tokens"] <= 2
    assert client.get("/readyz").json() == {"status": "ready", "backend": "builtin"}


def test_refusals_name_the_clients_field(client: TestClient) -> None:
    r = client.post(URL, json=_call(max_tokens=65), headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_tokens" and "at most 64" in r.json()["error"]["message"]
    r = client.post(URL, json=_call(temperature=3), headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text


def test_an_error_from_another_process_is_raised_as_it_was_answered() -> None:
    body = {
        "error": {
            "message": "slots full",
            "type": "invalid_request_error",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    err = ServingError.from_body(429, body, {"retry-after": "3", "content-type": "application/json"})
    assert (err.status_code, err.message, err.code, err.headers) == (
        429,
        "slots full",
        "rate_limit_exceeded",
        {"retry-after": "3"},
    )
    odd = ServingError.from_body(500, ["not", "an", "envelope"], {})
    assert odd.status_code == 502 and odd.code == "inference_backend_error"


def test_python_m_serving_refuses_to_start_without_a_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from serving.__main__ import main

    monkeypatch.delenv("ZENFLOW_API_INFERENCE_SERVER_TOKEN", raising=False)
    monkeypatch.chdir("/")  # no .env
    get_serving_settings.cache_clear()
    try:
        assert main(["--port", "0"]) == 2
    finally:
        get_serving_settings.cache_clear()
    assert "ZENFLOW_API_INFERENCE_SERVER_TOKEN" in capsys.readouterr().err

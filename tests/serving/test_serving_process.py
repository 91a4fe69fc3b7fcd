"""The serving process (``python -m serving``) as deployed: a real process the API (uvicorn, PostgreSQL)
sends chat and completions to with the shared token. Answers, streams and errors come back as the
in-process engine gives them; a flooding team does not hold another team's request to another model
(p99 over 20 runs within 2 s); the process refuses calls without the token (an API with another token
answers its clients 503, not 401);
an API whose serving process is gone answers 503 with Retry-After, and serves again once it is back.
(tests/serving/test_server.py: the same app in process, and its start refused without a token.)"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI
from pydantic import SecretStr

from store.settings import Settings
from tests.api.chat_support import register_fine_tuned, write_model_folder
from tests.api.conftest import (
    TEST_API_SETTINGS,
    Enqueued,
    ServerThread,
    TeamKey,
    error_of,
    free_port,
    make_team,
)
from tests.support import startup_seconds

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "serving-test-token"
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
#: The flooded model (slow per token) and the other team's model (fast).
FLOODED, OTHER = "small-llama", "tiny-llama"
pytestmark = pytest.mark.slow
#: Team B's p99 while team A floods (on a quiet 2-core box: 0.4-0.6 s measured).
P99_BOUND_SECONDS = 2.0


@contextlib.contextmanager
def serving_process(port: int, **env: str) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m serving`` on ``port``, ready (its /readyz answered) or the test fails with its log."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "serving", "--port", str(port), "--log-level", "warning"],
        cwd=ROOT,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("ZENFLOW_")},
            "ZENFLOW_API_INFERENCE_SERVER_TOKEN": TOKEN,
            "ZENFLOW_API_INFERENCE_THREADS": "1",
            "ZENFLOW_API_INFERENCE_QUEUE_SIZE": "8",
            "ZENFLOW_API_INFERENCE_RETRY_AFTER_SECONDS": "3",
            **env,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = (
            time.monotonic() + 10 * startup_seconds()
        )  # its start is an interpreter's and the ML stack's
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the serving process did not become ready"
            time.sleep(0.2)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def chat_requests_answered(url: str) -> float:
    """The serving process's count of chat requests (``zenflow_inference_requests_total``, any outcome)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("zenflow_inference_requests_total{") and 'endpoint="chat"' in line
    )


@pytest.fixture(scope="module")
def port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def serving(port: int) -> Iterator[subprocess.Popen[bytes]]:
    with serving_process(port) as proc:
        yield proc


@pytest.fixture(scope="module")
def api_app(settings: Settings, port: int) -> FastAPI:
    from api.app import create_app

    api = TEST_API_SETTINGS.model_copy(
        update={
            "inference_server_url": f"http://127.0.0.1:{port}",
            "inference_server_token": SecretStr(TOKEN),
        }
    )
    return create_app(settings, api, enqueue=Enqueued())


@pytest.fixture(scope="module")
def api(api_app: FastAPI, serving: subprocess.Popen[bytes]) -> Iterator[ServerThread]:
    with ServerThread(api_app) as s:
        yield s


def _sdk(api: ServerThread, team: TeamKey) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.base_url}/v1", api_key=team.key, max_retries=0, timeout=120)


def test_answers_streams_and_errors_come_through_the_serving_process(
    api: ServerThread, api_app: FastAPI, tmp_path: Path
) -> None:
    from serving.remote import RemoteEngine

    assert isinstance(api_app.state.inference, RemoteEngine)  # nothing decodes in the API's process
    team = make_team(api_app)
    ft = register_fine_tuned(api_app, team, write_model_folder(tmp_path / "final", seed=7))
    sdk = _sdk(api, team)
    whole = sdk.chat.completions.create(model=ft, messages=MESSAGES, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert whole.model == ft and whole.usage is not None and whole.usage.completion_tokens >= 1
    chunks = list(
        sdk.chat.completions.create(model=ft, messages=MESSAGES, max_tokens=12, temperature=0, stream=True)  # type: ignore[arg-type]
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )
    text = sdk.completions.create(model=OTHER, prompt=["a", "b"], max_tokens=3, temperature=0)
    assert [c.index for c in text.choices] == [0, 1]
    # the serving process's refusals, with their field, as the API's own
    r = httpx.post(
        f"{api.base_url}/v1/chat/completions",
        headers=team.headers,
        json={"model": ft, "messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 10},
        timeout=120,
    )
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded", r.text
    assert error_of(r)["param"] == "messages"
    other_team = make_team(api_app)
    r = httpx.post(
        f"{api.base_url}/v1/chat/completions",
        headers=other_team.headers,
        json={"model": ft, "messages": MESSAGES},
        timeout=60,
    )
    assert r.status_code == 404  # the API checks the team's access before the serving process sees it


def test_the_serving_process_answers_only_the_api(port: int, serving: subprocess.Popen[bytes]) -> None:
    call = {
        "team": "t",
        "model": {"id": OTHER, "source": OTHER},
        "request": {"model": OTHER, "messages": MESSAGES},
    }
    url = f"http://127.0.0.1:{port}/internal/v1/chat/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url, json=call, headers=headers, timeout=30)
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    ok = httpx.post(url, json=call, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
    assert ok.status_code == 200 and ok.json()["object"] == "chat.completion"
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text  # what Prometheus scrapes
    assert 'zenflow_inference_requests_total{backend="builtin",endpoint="chat",outcome="ok"}' in metrics


def test_another_teams_request_is_not_held_by_a_flood(api: ServerThread, api_app: FastAPI) -> None:
    """Team A floods one model (24 clients, long sampled answers) through the API; team B's short request
    is admitted and answered within 2 s at p99 over 20 runs: to another model (alone: tens of ms), and to
    the flooded model, whose running batch it joins rather than waiting for a flood answer to end. How
    much slower it is there than alone is the batch's step cost (the flood's rows and their long contexts
    in every forward pass), printed, not bounded: a 2-core CPU has no spare compute for them, a GPU's
    decode step barely notices them."""
    flooder, other = make_team(api_app), make_team(api_app)
    url = f"{api.base_url}/v1/chat/completions"
    short = {"model": OTHER, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    short_same = {**short, "model": FLOODED}
    long = {"model": FLOODED, "messages": MESSAGES, "max_tokens": 1000, "temperature": 2}
    alone = [_timed(url, other, short) for _ in range(5)]  # both models loaded by the first of each
    alone_same = [_timed(url, other, short_same) for _ in range(6)][1:]
    stop = threading.Event()
    flood_codes: list[int] = []
    flood_seconds: list[float] = []

    def flood() -> None:
        """A client looping as the openai SDK does: at once after an answer, after ``Retry-After`` on a
        429; streamed, so that it can leave (closing the stream stops the generation) when the test ends."""
        while not stop.is_set():
            t = time.monotonic()
            with httpx.stream(
                "POST", url, headers=flooder.headers, json={**long, "stream": True}, timeout=300
            ) as r:
                flood_codes.append(r.status_code)
                if r.status_code == 429:
                    stop.wait(float(r.headers["Retry-After"]))
                    continue
                for line in r.iter_lines():
                    if stop.is_set():
                        return
                    if line == "data: [DONE]":
                        flood_seconds.append(time.monotonic() - t)

    with concurrent.futures.ThreadPoolExecutor(24) as clients:
        floods = [clients.submit(flood) for _ in range(24)]
        try:
            time.sleep(2)  # the flood holds its share of the slots
            started = time.monotonic()
            waits = [_timed(url, other, short) for _ in range(20)]
            waits_same = [_timed(url, other, short_same) for _ in range(20)]
            window = time.monotonic() - started
        finally:
            stop.set()
        for f in floods:
            f.result()
    p99, p99_same = (statistics.quantiles(w, n=100, method="inclusive")[98] for w in (waits, waits_same))
    same_ratio = statistics.median(waits_same) / statistics.median(alone_same)
    print(
        f"team B, another model: alone median {statistics.median(alone):.3f} s; during the flood p99 "
        f"{p99:.3f} s, median {statistics.median(waits):.3f} s. The flooded model: alone median "
        f"{statistics.median(alone_same):.3f} s; during the flood p99 {p99_same:.3f} s, median "
        f"{statistics.median(waits_same):.3f} s ({same_ratio:.2f}x alone). Flood answers: "
        f"{len(flood_seconds)} in {sum(flood_seconds):.1f} s, codes {sorted(set(flood_codes))}"
    )
    assert 429 in flood_codes  # the flooding team was held to its share
    # 2 s, or on a loaded box (the CI's hog beside the suite) half of what waiting behind the flood
    # would cost: a flood answer's time (none ended while B measured: longer than that window)
    flood_answer = statistics.median(flood_seconds) if flood_seconds else window
    bound = max(P99_BOUND_SECONDS, flood_answer / 2)
    assert p99 <= bound, (bound, waits)
    assert p99_same <= bound, (bound, waits_same)  # joined the running batch, not behind it


def _timed(url: str, team: TeamKey, body: dict[str, object]) -> float:
    t = time.monotonic()
    r = httpx.post(url, headers=team.headers, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return time.monotonic() - t


def test_a_gone_serving_process_is_503_with_retry_after_then_served_again(
    settings: Settings, tmp_path: Path
) -> None:
    from api.app import create_app

    port = free_port()
    api = TEST_API_SETTINGS.model_copy(
        update={
            "inference_server_url": f"http://127.0.0.1:{port}",
            "inference_server_token": SecretStr(TOKEN),
        }
    )
    app = create_app(settings, api, enqueue=Enqueued())
    team = make_team(app)
    body = {"model": OTHER, "messages": MESSAGES, "max_tokens": 2}
    with ServerThread(app) as server:
        url = f"{server.base_url}/v1/chat/completions"
        r = httpx.post(url, headers=team.headers, json=body, timeout=60)
        assert r.status_code == 503 and r.headers["Retry-After"] == "5", r.text
        assert error_of(r)["code"] == "inference_backend_unavailable"
        with serving_process(port):
            assert httpx.post(url, headers=team.headers, json=body, timeout=120).status_code == 200
    app.state.engine.dispose()


def test_an_api_with_another_token_is_a_deployment_fault_not_the_clients(
    settings: Settings, port: int, serving: subprocess.Popen[bytes]
) -> None:
    """The serving process's 401 is about the API's token: the client gets 503, never 'invalid key'."""
    from api.app import create_app

    api = TEST_API_SETTINGS.model_copy(
        update={
            "inference_server_url": f"http://127.0.0.1:{port}",
            "inference_server_token": SecretStr("not-" + TOKEN),
        }
    )
    app = create_app(settings, api, enqueue=Enqueued())
    team = make_team(app)
    with ServerThread(app) as server:
        r = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            headers=team.headers,
            json={"model": OTHER, "messages": MESSAGES, "max_tokens": 2},
            timeout=60,
        )
    assert r.status_code == 503 and error_of(r)["code"] == "inference_backend_unavailable", r.text
    assert "token" in error_of(r)["message"]
    app.state.engine.dispose()

"""Chat and text completions on the built-in backend through the official openai SDK against uvicorn:
a team's fine-tuned model answers with usage and streams, greedy decoding matches transformers
run on the same folder, seeds, stop sequences and ``n`` behave as OpenAI's do, another team gets
404; a flood is answered 429 with Retry-After, a request to another model is answered while a flood's
long generations still run, a client that goes away mid-stream frees its slot and
stops its generation, a request over the time limit gets 504."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from store.settings import Settings
from tests.api.chat_support import metric_value, register_fine_tuned, write_model_folder
from tests.api.conftest import TEST_API_SETTINGS, Enqueued, ServerThread, TeamKey, error_of, make_team

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2?"}]
#: Slow enough per token (~20 ms on a CPU core) that a long generation outlasts the client's stay. Asked
#: greedily (temperature 0) its answer to MESSAGES never reaches the end-of-text token (it cycles through
#: 11 tokens for 1000), so such an answer is long by construction; sampled, it may end at any token.
SLOW_MODEL = "small-llama"


def _wait_for(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def chat_app(settings: Settings) -> FastAPI:
    from api.app import create_app

    api = TEST_API_SETTINGS.model_copy(
        update={
            "inference_threads": 1,
            "inference_queue_size": 1,
            "inference_max_tokens": 1000,
            "inference_retry_after_seconds": 3,
        }
    )
    return create_app(settings, api, enqueue=Enqueued())


@pytest.fixture(scope="module")
def server(chat_app: FastAPI) -> Iterator[ServerThread]:
    with ServerThread(chat_app) as s:
        yield s


@pytest.fixture(scope="module")
def owner(chat_app: FastAPI) -> TeamKey:
    return make_team(chat_app)


@pytest.fixture(scope="module")
def ft_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_folder(tmp_path_factory.mktemp("ft") / "final", seed=7)


@pytest.fixture(scope="module")
def ft_model(chat_app: FastAPI, owner: TeamKey, ft_folder: Path) -> str:
    return register_fine_tuned(chat_app, owner, ft_folder)


def _sdk(server: ServerThread, team: TeamKey) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=team.key, max_retries=0, timeout=60)


def _reference_greedy(folder: Path, max_new_tokens: int) -> tuple[str, int, int]:
    """transformers itself on the folder: greedy text, prompt tokens, completion tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
        )
    new = out[0, ids.shape[1] :]
    return tok.decode(new, skip_special_tokens=True), ids.shape[1], len(new)


def test_fine_tuned_model_answers_like_transformers_greedy(
    server: ServerThread, owner: TeamKey, ft_model: str, ft_folder: Path
) -> None:
    client = _sdk(server, owner)
    r = client.chat.completions.create(model=ft_model, messages=MESSAGES, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    expected, prompt_tokens, completion_tokens = _reference_greedy(ft_folder, 12)
    assert r.object == "chat.completion" and r.model == ft_model and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == expected
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, completion_tokens)
    assert r.usage.total_tokens == prompt_tokens + completion_tokens
    assert r.choices[0].finish_reason == ("length" if completion_tokens == 12 else "stop")
    again = client.chat.completions.create(
        model=ft_model,
        messages=MESSAGES,
        max_completion_tokens=12,  # type: ignore[arg-type]
        temperature=0,
    )
    assert again.choices[0].message.content == expected  # greedy is deterministic


def test_stream_yields_chunks_and_ends(server: ServerThread, owner: TeamKey, ft_model: str) -> None:
    client = _sdk(server, owner)
    whole = client.chat.completions.create(model=ft_model, messages=MESSAGES, max_tokens=10, temperature=0)  # type: ignore[arg-type]
    chunks = list(
        client.chat.completions.create(
            model=ft_model,
            messages=MESSAGES,
            max_tokens=10,  # type: ignore[call-overload]
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len(chunks) >= 3 and all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_seed_n_and_stop_sequences(server: ServerThread, owner: TeamKey, ft_model: str) -> None:
    client = _sdk(server, owner)

    def sample(**kw: Any) -> list[str]:
        r = client.chat.completions.create(model=ft_model, messages=MESSAGES, max_tokens=16, **kw)  # type: ignore[call-overload]
        assert [c.index for c in r.choices] == list(range(len(r.choices)))
        return [c.message.content for c in r.choices]

    seeded = sample(temperature=1.0, seed=11, n=3)
    assert len(seeded) == 3 and sample(temperature=1.0, seed=11, n=3) == seeded  # same seed, same samples
    assert len(set(seeded)) > 1  # the choices are drawn one after another, not copies
    assert sample(temperature=1.0, seed=12, n=3) != seeded

    full = client.chat.completions.create(model=ft_model, messages=MESSAGES, max_tokens=16, temperature=0)  # type: ignore[arg-type]
    text = full.choices[0].message.content or ""
    stop = next(ch for ch in text[1:] if ch.isascii() and ch.isprintable())
    cut = client.chat.completions.create(
        model=ft_model,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,  # type: ignore[arg-type]
        stop=[stop, "never-generated"],
    )
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model=ft_model,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,  # type: ignore[call-overload]
        stop=stop,
        stream=True,
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[: text.index(stop)]
    )


def test_text_completions(server: ServerThread, owner: TeamKey) -> None:
    client = _sdk(server, owner)
    r = client.completions.create(
        model="tiny-llama", prompt=["Paris is", "Rome is"], max_tokens=5, temperature=0, echo=True
    )
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text.startswith("Paris is") and r.choices[1].text.startswith("Rome is")
    assert (
        r.usage is not None
        and r.usage.completion_tokens <= 10
        and r.usage.prompt_tokens == len(b"Paris is") + len(b"Rome is")
    )  # byte tokens
    chunks = list(
        client.completions.create(
            model="tiny-llama", prompt="Paris is", max_tokens=5, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text[len("Paris is") :]
    # an empty prompt (OpenAI accepts "") starts from the model's bos token: an answer, not a 500
    empty = client.completions.create(model="tiny-llama", prompt=["", "x"], max_tokens=2, temperature=0)
    assert [c.index for c in empty.choices] == [0, 1] and empty.usage is not None
    assert empty.usage.prompt_tokens == 1 + len(b"x")


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"max_tokens": 1001}, "max_tokens"),  # over the server's inference_max_tokens
        ({"max_completion_tokens": 1020}, "max_completion_tokens"),  # prompt + this exceed the context
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"model": "../etc"}, "model"),
        (
            {"messages": [{"role": "user", "content": "\ud800"}]},
            "messages[0].content",
        ),  # no tokenizer takes it
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content",
        ),
    ],
)
def test_bad_requests_name_the_field(
    server: ServerThread, owner: TeamKey, change: dict[str, Any], param: str
) -> None:
    body = json.dumps(
        {"model": "tiny-llama", "messages": MESSAGES, **change}
    )  # ASCII: a lone surrogate escaped
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        content=body,
        timeout=60,
        headers={**owner.headers, "Content-Type": "application/json"},
    )
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == param


def test_another_teams_model_is_404(server: ServerThread, chat_app: FastAPI, ft_model: str) -> None:
    stranger = make_team(chat_app)
    for endpoint, body in (("chat/completions", {"messages": MESSAGES}), ("completions", {"prompt": "hi"})):
        for stream in (False, True):
            r = httpx.post(
                f"{server.base_url}/v1/{endpoint}",
                headers=stranger.headers,
                timeout=60,
                json={"model": ft_model, "stream": stream, **body},
            )
            assert r.status_code == 404, r.text
            assert error_of(r)["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        _sdk(server, stranger).chat.completions.create(model=ft_model, messages=MESSAGES)  # type: ignore[arg-type]


def _chat(server: ServerThread, team: TeamKey, max_tokens: int) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/chat/completions",
        headers=team.headers,
        timeout=120,
        json={"model": SLOW_MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0},
    )


def test_flood_gets_429_with_retry_after_and_slots_come_back(
    server: ServerThread, chat_app: FastAPI, owner: TeamKey
) -> None:
    assert _chat(server, owner, 1).status_code == 200  # the model is loaded before the flood
    pool = chat_app.state.inference.builtin.pool
    with concurrent.futures.ThreadPoolExecutor(8) as clients:
        answers = list(clients.map(lambda _: _chat(server, owner, 30), range(8)))
    refused = [r for r in answers if r.status_code == 429]
    assert {r.status_code for r in answers} <= {200, 429}
    assert refused and len(refused) <= 8 - 1  # one thread + one waiting place: at least one is served
    for r in refused:
        assert r.headers["Retry-After"] == "3" and error_of(r)["code"] == "rate_limit_exceeded"
    _wait_for(lambda: pool.slots_in_use == 0)
    assert _chat(server, owner, 1).status_code == 200


def _completion_tokens(server: ServerThread) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return metric_value(text, "zenflow_inference_tokens_total", endpoint="chat", kind="completion")


def _cancelled(server: ServerThread) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return metric_value(
        text, "zenflow_inference_requests_total", endpoint="chat", backend="builtin", outcome="cancelled"
    )


def test_client_that_disconnects_mid_stream_frees_its_slot(
    server: ServerThread, chat_app: FastAPI, owner: TeamKey
) -> None:
    pool = chat_app.state.inference.builtin.pool
    assert _chat(server, owner, 1).status_code == 200
    tokens_before, cancelled_before = _completion_tokens(server), _cancelled(server)
    body = {"model": SLOW_MODEL, "messages": MESSAGES, "max_tokens": 1000, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/chat/completions", json=body, headers=owner.headers, timeout=60
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert pool.slots_in_use == 1
    # The connection is closed: the generation stops at its next token and lets go of the slot.
    _wait_for(lambda: pool.slots_in_use == 0)
    _wait_for(lambda: _cancelled(server) == cancelled_before + 1)
    assert _completion_tokens(server) - tokens_before < 1000  # stopped, not run to max_tokens
    assert _chat(server, owner, 2).status_code == 200  # the next request is served


def test_client_that_gives_up_on_a_whole_answer_frees_its_slot(
    server: ServerThread, chat_app: FastAPI, owner: TeamKey
) -> None:
    pool = chat_app.state.inference.builtin.pool
    assert _chat(server, owner, 1).status_code == 200
    tokens_before, cancelled_before = _completion_tokens(server), _cancelled(server)
    with pytest.raises(httpx.ReadTimeout):  # the client stops waiting and closes the connection
        httpx.post(
            f"{server.base_url}/v1/chat/completions",
            headers=owner.headers,
            timeout=httpx.Timeout(60, read=1),
            json={"model": SLOW_MODEL, "messages": MESSAGES, "max_tokens": 1000, "temperature": 0},
        )
    _wait_for(lambda: pool.slots_in_use == 0)
    _wait_for(lambda: _cancelled(server) == cancelled_before + 1)
    assert _completion_tokens(server) - tokens_before < 1000  # stopped, not run to max_tokens
    assert _chat(server, owner, 2).status_code == 200


def test_request_over_the_time_limit_gets_504(settings: Settings) -> None:
    from api.app import create_app

    app = create_app(
        settings, TEST_API_SETTINGS.model_copy(update={"inference_timeout_seconds": 0.3}), enqueue=Enqueued()
    )
    team = make_team(app)
    with TestClient(app) as c:
        r = c.post(
            "/v1/chat/completions",
            headers=team.headers,
            json={"model": SLOW_MODEL, "messages": MESSAGES, "max_tokens": 1000, "temperature": 0},
        )
        assert r.status_code == 504, r.text
        assert error_of(r)["code"] == "timeout"
        _wait_for(lambda: app.state.inference.builtin.pool.slots_in_use == 0)


def test_per_request_caps_are_400s_before_anything_runs(settings: Settings) -> None:
    """Prompts counted before admission (60,000 of them refused without one being tokenized), tokens of
    a prompt and of all of them, prompts x n x max_tokens; a request without max_tokens gets a default
    that fits."""
    from api.app import create_app

    app = create_app(
        settings,
        TEST_API_SETTINGS.model_copy(
            update={
                "inference_max_prompts": 3,
                "inference_max_prompt_tokens": 8,
                "inference_max_request_prompt_tokens": 12,
                "inference_max_request_tokens": 20,
            }
        ),
        enqueue=Enqueued(),
    )
    team = make_team(app)

    def post(path: str, **body: Any) -> Any:
        return c.post(f"/v1/{path}", headers=team.headers, json={"model": "tiny-llama", **body})

    with TestClient(app) as c:
        t0 = time.monotonic()
        r = post("completions", prompt=["a"] * 60000, n=16)
        assert r.status_code == 400 and error_of(r)["param"] == "prompt", r.text
        assert "60000 prompts" in error_of(r)["message"] and time.monotonic() - t0 < 10
        cases: list[tuple[str, dict[str, Any], str]] = [
            ("completions", {"prompt": ["a", "b", "c", "d"]}, "prompt"),
            ("completions", {"prompt": "abcdefghij"}, "prompt"),  # 10 byte tokens > 8
            ("completions", {"prompt": ["ok", "abcdefghij"]}, "prompt[1]"),
            ("completions", {"prompt": ["abcdefg", "abcdefg"]}, "prompt"),  # 7 + 7 > 12 in all
            ("completions", {"prompt": "a", "n": 3, "max_tokens": 7}, "max_tokens"),  # 3 x 7 > 20
            ("completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 6}, "max_tokens"),  # 2 x 2 x 6
            (
                "chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "n": 5, "max_tokens": 5},
                "max_tokens",
            ),
            ("chat/completions", {"messages": [{"role": "user", "content": "a long message"}]}, "messages"),
        ]
        for path, body, param in cases:
            r = post(path, **body)
            assert r.status_code == 400, (body, r.text)
            assert error_of(r)["param"] == param, (body, error_of(r))
        assert app.state.inference.builtin.pool.slots_in_use == 0
        # no max_tokens: 2 prompts x n 3 = 6 choices share the 20 tokens, 3 each at most
        r = post("completions", prompt=["a", "b"], n=3, temperature=1.0, seed=1)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 6 and r.json()["usage"]["completion_tokens"] <= 18
        _wait_for(lambda: app.state.inference.builtin.pool.slots_in_use == 0)


def test_a_flooding_team_gets_429_while_another_team_is_served(
    server: ServerThread, chat_app: FastAPI, owner: TeamKey
) -> None:
    """Two slots (one thread, one waiting place): a team alone may hold both, and a second team asking
    then is admitted at once and answered while the first team's requests still run."""
    assert _chat(server, owner, 1).status_code == 200  # the model is loaded before the flood
    pool = chat_app.state.inference.builtin.pool
    flooder, other = make_team(chat_app), make_team(chat_app)
    with concurrent.futures.ThreadPoolExecutor(6) as clients:
        flood = [clients.submit(_chat, server, flooder, 300) for _ in range(6)]
        _wait_for(lambda: pool.shares.held(flooder.id) == 2 or all(f.done() for f in flood))
        assert pool.shares.held(flooder.id) == 2, [f.result().status_code for f in flood]
        r = _chat(server, other, 5)
        assert r.status_code == 200, r.text
        assert pool.shares.held(flooder.id) == 2  # served alongside the flood, not after it
        answers = [f.result() for f in flood]
    assert sorted(a.status_code for a in answers) == [200, 200, 429, 429, 429, 429]
    for a in answers:
        if a.status_code == 429:
            assert a.headers["Retry-After"] == "3" and error_of(a)["code"] == "rate_limit_exceeded"
            assert "Your team has 2 inference requests in progress" in error_of(a)["message"]
    _wait_for(lambda: pool.slots_in_use == 0)


def test_another_model_is_served_while_a_team_floods_one(
    server: ServerThread, chat_app: FastAPI, owner: TeamKey
) -> None:
    """One decode thread: two long generations of one team on one model take turns with another team's
    short request to another model (time slices), which is answered while they still run, not after."""
    other_model = "tiny-llama"
    flooder, other = make_team(chat_app), make_team(chat_app)
    assert _chat(server, owner, 1).status_code == 200  # both models loaded before the flood
    short = {"model": other_model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    url = f"{server.base_url}/v1/chat/completions"
    assert httpx.post(url, headers=owner.headers, json=short, timeout=120).status_code == 200
    answered = threading.Event()
    streaming = [threading.Event(), threading.Event()]

    def flood(i: int) -> str:
        """Stream a long answer until the other team's is in: ``open`` if it still ran then."""
        body = {
            "model": SLOW_MODEL,
            "messages": MESSAGES,
            "max_tokens": 1000,
            "temperature": 0,
            "stream": True,
        }
        with httpx.stream("POST", url, json=body, headers=flooder.headers, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    return "finished"
                streaming[i].set()
                if answered.is_set():
                    return "open"  # the client leaves: its generation stops
        return "ended"

    with concurrent.futures.ThreadPoolExecutor(2) as clients:
        floods = [clients.submit(flood, i) for i in range(2)]
        assert all(e.wait(120) for e in streaming), [f.result() for f in floods if f.done()]
        r = httpx.post(url, headers=other.headers, json=short, timeout=120)
        answered.set()
        assert r.status_code == 200, r.text
        assert [f.result() for f in floods] == ["open", "open"]  # answered while both still generated
    _wait_for(lambda: chat_app.state.inference.builtin.pool.slots_in_use == 0)


def _batch_steps(server: ServerThread) -> tuple[float, float]:
    """Forward passes of the built-in backend so far, and those that decoded a single choice."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return (
        metric_value(text, "zenflow_inference_batch_rows_count"),
        metric_value(text, "zenflow_inference_batch_rows_bucket", le="1.0"),
    )


def test_concurrent_requests_share_forward_passes_and_answer_as_alone(
    server: ServerThread, chat_app: FastAPI
) -> None:
    """Requests of three teams for the same model, sent at once, are decoded in the same forward passes
    (prompts of different lengths, greedy): each answer is the one it gets alone. A fourth client that
    goes away mid-stream leaves the batch; the others are unaffected."""
    teams = [make_team(chat_app) for _ in range(4)]
    prompts = ["Paris is", "The river runs through the old town and", "x"]

    def complete(team: TeamKey, prompt: str) -> str:
        r = httpx.post(
            f"{server.base_url}/v1/completions",
            headers=team.headers,
            timeout=120,
            json={"model": SLOW_MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        text: str = r.json()["choices"][0]["text"]
        return text

    alone = [complete(t, p) for t, p in zip(teams, prompts, strict=False)]
    steps, single = _batch_steps(server)

    def leaver() -> None:
        body = {"model": SLOW_MODEL, "prompt": "going", "max_tokens": 1000, "temperature": 0, "stream": True}
        with httpx.stream(
            "POST", f"{server.base_url}/v1/completions", json=body, headers=teams[3].headers, timeout=60
        ) as r:
            assert r.status_code == 200
            events = (line for line in r.iter_lines() if line.startswith("data: "))
            for _ in range(5):
                next(events)

    with concurrent.futures.ThreadPoolExecutor(4) as clients:
        gone = clients.submit(leaver)
        together = list(clients.map(complete, teams, prompts))
        gone.result()
    assert together == alone
    steps_after, single_after = _batch_steps(server)
    assert steps_after - steps > single_after - single  # some forward passes decoded several requests
    _wait_for(lambda: chat_app.state.inference.builtin.pool.slots_in_use == 0)

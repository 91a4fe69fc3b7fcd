"""``inference_backend: vllm``: the forwarding path against a small local server that speaks vLLM's
OpenAI API (vLLM itself needs a GPU). A LoRA fine-tuned model is loaded there as an adapter named by
its ``ft:`` id and answered by it, streams pass through chunk by chunk, a model the server does not
serve stays on the built-in backend, and the server's errors come back in our envelope."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from store.settings import Settings
from tests.api.chat_support import register_fine_tuned, write_model_folder
from tests.api.conftest import TEST_API_SETTINGS, Enqueued, ServerThread, TeamKey, error_of, make_team

MESSAGES = [{"role": "user", "content": "hello"}]


@dataclass
class FakeVLLM:
    """What the fake server was asked."""

    adapters: dict[str, str] = field(default_factory=dict)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    #: Streams that ended before their last chunk (the connection was closed).
    aborted: int = 0


def fake_vllm_app(seen: FakeVLLM) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        ids = ["served-base", *seen.adapters]
        return {"object": "list", "data": [{"id": i, "object": "model"} for i in ids]}

    @app.post("/v1/load_lora_adapter")
    async def load_adapter(body: dict[str, str]) -> Any:
        if body["lora_name"] in seen.adapters:
            return JSONResponse({"error": {"message": "The lora adapter has already been loaded."}}, 400)
        seen.adapters[body["lora_name"]] = body["lora_path"]
        return "Success: LoRA adapter loaded"

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        seen.bodies.append(body)
        if body.get("max_tokens") == 999:
            return JSONResponse(
                {
                    "error": {
                        "message": "max_tokens is too large for vLLM",
                        "type": "BadRequestError",
                        "param": "max_tokens",
                        "code": 400,
                    }
                },
                400,
            )
        base = {"id": "chatcmpl-vllm", "created": int(time.time()), "model": body["model"]}
        if not body.get("stream"):
            return {
                **base,
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": f"vllm:{body['model']}"},
                    }
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            }

        pieces = ["vllm", ":", "stream"] if body.get("max_tokens") != 500 else ["x"] * 500

        async def events() -> AsyncIterator[str]:
            finished = False
            try:
                for piece in pieces:
                    chunk = {
                        **base,
                        "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}],
                    }
                    yield f"data: {json.dumps(chunk)}\n\n"
                    if len(pieces) > 3:
                        await asyncio.sleep(0.05)  # a long generation
                yield "data: [DONE]\n\n"
                finished = True
            finally:
                if not finished:
                    seen.aborted += 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def seen() -> FakeVLLM:
    return FakeVLLM()


@pytest.fixture(scope="module")
def vllm(seen: FakeVLLM) -> Iterator[ServerThread]:
    with ServerThread(fake_vllm_app(seen)) as s:
        yield s


@pytest.fixture(scope="module")
def app(settings: Settings, vllm: ServerThread) -> FastAPI:
    from api.app import create_app

    api = TEST_API_SETTINGS.model_copy(
        update={"inference_backend": "vllm", "inference_vllm_url": vllm.base_url}
    )
    return create_app(settings, api, enqueue=Enqueued())


@pytest.fixture(scope="module")
def server(app: FastAPI) -> Iterator[ServerThread]:
    with ServerThread(app) as s:
        yield s


@pytest.fixture(scope="module")
def owner(app: FastAPI) -> TeamKey:
    return make_team(app)


@pytest.fixture(scope="module")
def lora_model(app: FastAPI, owner: TeamKey, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    folder = write_model_folder(tmp_path_factory.mktemp("lora") / "final", seed=3, adapter=True)
    return register_fine_tuned(app, owner, folder, suffix="lora"), folder / "adapter"


def test_lora_model_is_served_by_vllm_as_an_adapter(
    server: ServerThread, owner: TeamKey, seen: FakeVLLM, lora_model: tuple[str, Path]
) -> None:
    model_id, adapter = lora_model
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=owner.key, max_retries=0)
    r = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    assert r.choices[0].message.content == f"vllm:{model_id}"
    assert seen.adapters == {model_id: str(adapter)}
    assert seen.bodies[-1] == {"model": model_id, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    assert r.usage is not None and r.usage.total_tokens == 5

    chunks = list(client.chat.completions.create(model=model_id, messages=MESSAGES, stream=True))  # type: ignore[call-overload]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "vllm:stream"
    assert seen.adapters == {model_id: str(adapter)}  # loaded once


def test_a_client_leaving_a_stream_closes_the_upstream_request(
    server: ServerThread, app: FastAPI, owner: TeamKey, seen: FakeVLLM, lora_model: tuple[str, Path]
) -> None:
    body = {"model": lora_model[0], "messages": MESSAGES, "max_tokens": 500, "stream": True}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/chat/completions", json=body, headers=owner.headers, timeout=30
    ) as r:
        assert r.status_code == 200 and next(r.iter_lines()).startswith("data: ")
    deadline = time.monotonic() + 20
    while seen.aborted == 0 or app.state.inference.vllm.in_flight:
        assert time.monotonic() < deadline, "the upstream stream was not closed"
        time.sleep(0.05)


def test_models_vllm_does_not_serve_stay_built_in(
    server: ServerThread, owner: TeamKey, seen: FakeVLLM
) -> None:
    before = len(seen.bodies)
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        headers=owner.headers,
        timeout=60,
        json={"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 3},
    )
    assert r.status_code == 200, r.text
    assert not r.json()["choices"][0]["message"]["content"].startswith("vllm:")
    assert len(seen.bodies) == before


def test_vllm_errors_come_back_in_our_envelope(
    server: ServerThread, owner: TeamKey, lora_model: tuple[str, Path]
) -> None:
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        headers=owner.headers,
        timeout=60,
        json={"model": lora_model[0], "messages": MESSAGES, "max_tokens": 999},
    )
    assert r.status_code == 400
    err = error_of(r)
    assert err["message"] == "max_tokens is too large for vLLM" and err["param"] == "max_tokens"


def test_foreign_model_never_reaches_vllm(
    server: ServerThread, app: FastAPI, seen: FakeVLLM, lora_model: tuple[str, Path]
) -> None:
    before = len(seen.bodies)
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        headers=make_team(app).headers,
        timeout=60,
        json={"model": lora_model[0], "messages": MESSAGES},
    )
    assert r.status_code == 404 and len(seen.bodies) == before


def test_an_answer_that_fails_mid_read_frees_its_slot() -> None:
    """vLLM answers 200 and then the body times out: a 504, and the slot is free again (no 429 later)."""
    from serving.errors import ServingError
    from serving.vllm import VLLMForwarder

    class TimesOut(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            raise httpx.ReadTimeout("slow upstream")
            yield b""  # an async generator

    forwarder = VLLMForwarder(
        "http://vllm",
        timeout_seconds=5,
        max_requests=1,
        transport=httpx.MockTransport(lambda _: httpx.Response(200, stream=TimesOut())),
    )

    async def twice() -> list[int]:
        codes = []
        for _ in range(2):
            with pytest.raises(ServingError) as err:
                await forwarder.forward(
                    "/v1/chat/completions", {"model": "m"}, "m", stream=False, endpoint="chat"
                )
            codes.append(err.value.status_code)
        return codes

    assert asyncio.run(twice()) == [504, 504]
    assert forwarder.in_flight == 0

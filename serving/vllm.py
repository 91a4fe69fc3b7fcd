"""Forwarding to a vLLM server's OpenAI API (``inference_backend: vllm``, the compose profile ``vllm``).

What vLLM serves is decided per model: a fine-tuned model or checkpoint trained with LoRA is loaded
into vLLM as an adapter named by its ``ft:`` id (``POST /v1/load_lora_adapter``; vLLM runs with
``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; the adapter folder is on the volume both
containers mount at the same path), and any model whose id vLLM lists in ``GET /v1/models`` (its
``--served-model-name``) goes there too. Everything else, e.g. a fully fine-tuned model or a built-in
config, stays on the built-in backend. The request body goes on unchanged but for ``model``; a
stream is passed through chunk by chunk, and closing it (the client went away) closes the upstream
request, which vLLM aborts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import httpx
from fastapi.responses import JSONResponse, Response

from serving import prometheus
from serving.errors import ServingError
from serving.errors import backend_unavailable as unavailable
from serving.http_pool import LazyPool
from serving.responses import EventStream

if TYPE_CHECKING:
    from serving.client import ServedModel

log = logging.getLogger(__name__)

BACKEND = "vllm"
#: How long vLLM's model list is trusted before it is asked again.
SERVED_TTL_SECONDS = 10.0


def upstream_error(status: int, content: bytes) -> ServingError:
    """vLLM's error as ours: its message (OpenAI's envelope, or vLLM's older flat one) and its status
    for client errors; a 5xx of vLLM is a 502 of ours."""
    message, param = f"The inference server answered {status}", None
    try:
        body = httpx.Response(status, content=content).json()
        err = body.get("error", body) if isinstance(body, dict) else {}
        if isinstance(err, dict):
            message = str(err.get("message") or message)
            param = err.get("param") if isinstance(err.get("param"), str) else None
    except ValueError:
        pass
    if 400 <= status < 500 and status not in (401, 403):  # our key is not the client's business
        return ServingError(status, message, param=param)
    return ServingError(502, message, code="inference_backend_error")


class VLLMForwarder:
    def __init__(
        self,
        base_url: str,
        *,
        timeout_seconds: float,
        max_requests: int,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not base_url:
            raise ValueError("inference_vllm_url is required with inference_backend=vllm")
        self.max_requests = max_requests
        self.in_flight = 0
        self._pool = LazyPool(
            base_url, transport=transport, timeout=httpx.Timeout(timeout_seconds, connect=5.0)
        )
        self._served: set[str] = set()
        self._served_at = -SERVED_TTL_SECONDS
        self._adapters: set[str] = set()

    @property
    def _client(self) -> httpx.AsyncClient:
        return self._pool.client

    async def aclose(self) -> None:
        await self._pool.aclose()

    async def route(self, model: ServedModel) -> str | None:
        """The model name to send to vLLM for ``model``, or None: the built-in backend serves it."""
        if model.adapter_path is not None and await self._ensure_adapter(model.id, model.adapter_path):
            return model.id
        return model.id if model.id in await self._served_models() else None

    async def forward(
        self, path: str, body: dict[str, Any], upstream_model: str, *, stream: bool, endpoint: str
    ) -> Response:
        """``body`` sent to vLLM's ``path`` with ``model`` replaced; its answer, streamed or whole."""
        if self.in_flight >= self.max_requests:
            prometheus.request_done(endpoint, BACKEND, "rejected")
            raise ServingError(
                429,
                "Too many inference requests in progress; retry after 1 s",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        started = time.monotonic()
        self.in_flight += 1
        try:
            request = self._client.build_request("POST", path, json={**body, "model": upstream_model})
            response = await self._client.send(request, stream=True)
        except httpx.TimeoutException as e:
            self._finish(endpoint, "timeout", started=started)
            raise ServingError(504, "The inference server did not answer in time", code="timeout") from e
        except httpx.HTTPError as e:
            self._finish(endpoint, "error", started=started)
            raise unavailable(type(e).__name__) from e
        if response.status_code != 200 or not stream:
            # A whole answer (or an error) read here: the slot is freed however the read ends (a
            # timeout, a dropped connection, this request cancelled).
            outcome = "error"
            try:
                content = await response.aread()
                outcome = "ok" if response.status_code == 200 else "error"
            except httpx.TimeoutException as e:
                outcome = "timeout"
                raise ServingError(504, "The inference server did not answer in time", code="timeout") from e
            except httpx.HTTPError as e:
                raise unavailable(type(e).__name__) from e
            finally:
                await response.aclose()
                self._finish(endpoint, outcome, started=started)
            if response.status_code != 200:
                if response.status_code == 404:  # vLLM restarted and lost its adapters: load again next time
                    self._adapters.discard(upstream_model)
                raise upstream_error(response.status_code, content)
            return JSONResponse(httpx.Response(200, content=content).json())
        upstream = _Upstream(response, partial(self._finish, endpoint, started=started))
        return EventStream(upstream.chunks(), on_close=upstream.close)

    def _finish(self, endpoint: str, outcome: str, *, started: float) -> None:
        self.in_flight -= 1
        prometheus.request_done(endpoint, BACKEND, outcome, time.monotonic() - started)

    async def _served_models(self) -> set[str]:
        if time.monotonic() - self._served_at < SERVED_TTL_SECONDS:
            return self._served
        try:
            r = await self._client.get("/v1/models")
            r.raise_for_status()
            self._served = {
                str(m["id"]) for m in r.json().get("data", []) if isinstance(m, dict) and "id" in m
            }
        except (httpx.HTTPError, ValueError, KeyError) as e:
            raise unavailable(f"listing its models failed ({type(e).__name__})") from e
        self._served_at = time.monotonic()
        return self._served

    async def _ensure_adapter(self, name: str, path: str) -> bool:
        """Load the LoRA adapter ``path`` into vLLM as ``name`` (once); False when vLLM refuses it
        (e.g. trained on another base than the one it serves)."""
        if name in self._adapters:
            return True
        try:
            r = await self._client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        except httpx.HTTPError as e:
            raise unavailable(f"loading the adapter failed ({type(e).__name__})") from e
        if r.status_code == 200 or "already" in r.text.lower():
            self._adapters.add(name)
            return True
        log.warning("vLLM refused adapter %s (%s): %s", name, r.status_code, r.text[:500])
        return False


class _Upstream:
    """One streamed answer of vLLM passed through; closed (the connection too, so vLLM aborts an
    unfinished generation) however the client's stream ends."""

    def __init__(self, response: httpx.Response, finish: Callable[[str], None]) -> None:
        self.response, self.finish = response, finish
        self.outcome = "cancelled"
        self.closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.response.aiter_raw():
                yield chunk
            self.outcome = "ok"
        except httpx.HTTPError:
            self.outcome = "error"
            log.warning("vLLM stream broke off", exc_info=True)

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self.response.aclose()
            self.finish(self.outcome)

"""The engine in the serving process, reached over HTTP (``inference_server_url``): what the API runs
when serving is deployed apart, so decode work never competes with the control plane.

Each request goes to the serving process (``serving.server``) as the validated body, the model the API
resolved for the team and the team, with the shared ``inference_server_token``. Its answer comes back
as it is: the completion, a stream passed through chunk by chunk (closing it closes the connection,
which stops the generation), or its error (status, envelope, ``Retry-After``). While the answer has not
started, the client going away closes the connection too. A serving process that cannot be reached is a
503 ``inference_backend_unavailable`` with ``Retry-After``; every wait on it is bounded (connect, and the
serving process's own request timeout plus a margin).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi.responses import JSONResponse

from contract.serving import INTERNAL_PATHS
from serving.client import Call, Reply
from serving.errors import ServingError
from serving.errors import backend_unavailable as unavailable
from serving.http_pool import LazyPool
from serving.responses import EventStream

log = logging.getLogger(__name__)

CONNECT_SECONDS = 5.0
#: Beyond the serving process's own limit (it answers 504 itself at ``inference_timeout_seconds``).
TIMEOUT_MARGIN_SECONDS = 30.0
DISCONNECT_POLL_SECONDS = 0.25


def timed_out() -> ServingError:
    return ServingError(504, "The inference server did not answer in time", code="timeout")


class RemoteEngine:
    """An :class:`~serving.client.EngineClient` for the serving process at ``base_url``."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout_seconds: float,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not base_url or not token:
            raise ValueError("inference_server_url needs inference_server_token (the serving process's)")
        self._pool = LazyPool(
            base_url,
            transport=transport,
            timeout=httpx.Timeout(timeout_seconds + TIMEOUT_MARGIN_SECONDS, connect=CONNECT_SECONDS),
            headers={"Authorization": f"Bearer {token}"},
        )

    @property
    def _client(self) -> httpx.AsyncClient:
        return self._pool.client

    async def aclose(self) -> None:
        await self._pool.aclose()

    async def generate(self, call: Call) -> Reply:
        payload = {
            "team": call.team,
            "model": call.model.model_dump(),
            "request": call.body.model_dump(mode="json", exclude_unset=True),
        }
        request = self._client.build_request("POST", INTERNAL_PATHS[call.endpoint], json=payload)
        response = await self._send_watching(request, call)
        if response.status_code != 200 or not call.body.stream:
            content = await self._read(response)
            if response.status_code == 401:  # our token, not the client's key: a deployment fault
                log.error("the serving process refused this API's inference_server_token")
                raise unavailable("it refused this server's token")
            if response.status_code != 200:
                raise ServingError.from_body(response.status_code, _json(content), dict(response.headers))
            return JSONResponse(_json(content))
        return EventStream(_chunks(response), on_close=response.aclose)

    async def _send_watching(self, request: httpx.Request, call: Call) -> httpx.Response:
        """The serving process's answer (its head); the request abandoned when the client goes away."""
        send = asyncio.ensure_future(self._client.send(request, stream=True))
        try:
            while True:
                done, _ = await asyncio.wait({send}, timeout=DISCONNECT_POLL_SECONDS)
                if done:
                    return send.result()
                if await call.disconnected():
                    raise ServingError(499, "The client closed the request", code="client_closed_request")
        except httpx.TimeoutException as e:
            raise timed_out() from e
        except httpx.HTTPError as e:
            raise unavailable(type(e).__name__) from e
        finally:
            if not send.done():
                send.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await send

    @staticmethod
    async def _read(response: httpx.Response) -> bytes:
        try:
            return await response.aread()
        except httpx.TimeoutException as e:
            raise timed_out() from e
        except httpx.HTTPError as e:
            raise unavailable(type(e).__name__) from e
        finally:
            await response.aclose()


def _json(content: bytes) -> Any:
    try:
        return httpx.Response(200, content=content).json()
    except ValueError:
        log.warning("the inference server answered something that is not JSON: %r", content[:200])
        raise unavailable("its answer was not JSON") from None


async def _chunks(response: httpx.Response) -> AsyncIterator[bytes]:
    """The serving process's stream as it comes; a connection that breaks ends it with an error event."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError as e:
        log.warning("the inference server's stream broke off: %s", type(e).__name__)
        yield b'data: {"error": {"message": "The inference server stopped answering", "type": "server_error", "param": null, "code": "inference_backend_unavailable"}}\n\n'

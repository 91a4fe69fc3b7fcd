"""A cap on request bodies other than file uploads (pure ASGI, so streaming bodies are counted too).

JSON request bodies here are small (a job is a few hundred bytes); without a cap a client can make
the server buffer and parse an arbitrarily large body. A request whose ``Content-Length`` is over the
cap is answered 413 before any of it is read; a chunked body is counted as it arrives and refused
once it passes the cap. ``POST /v1/files`` is exempt: uploads stream to disk under their own limit
(``max_upload_bytes``).
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.core.errors import APIError

#: (method, path) pairs whose bodies are limited elsewhere.
EXEMPT = frozenset({("POST", "/v1/files")})


CODE = "request_too_large"


def _message(limit: int) -> str:
    return f"The request body is over the server's limit of {limit} bytes (`max_body_bytes`)"


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once a streamed body passes the cap. An HTTPException, so FastAPI's body
    reading passes it on (any other error there becomes a 400) and the app's handler answers it."""

    error_code = CODE

    def __init__(self, limit: int) -> None:
        super().__init__(413, _message(limit))


def _too_large(limit: int) -> APIError:
    return APIError(413, _message(limit), code=CODE)


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"].rstrip("/")) in EXEMPT:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _too_large(self.max_bytes).response()(scope, receive, send)
            return

        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if started:  # too late for a status; the connection is dropped by the server
                raise
            await _too_large(self.max_bytes).response()(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None

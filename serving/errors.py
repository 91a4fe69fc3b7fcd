"""The OpenAI error envelope ``{"error": {"message", "type", "param", "code"}}`` as an exception: what
an engine raises for a request it refuses or cannot finish, and what travels between the API and the
serving process (status, envelope and headers, e.g. ``Retry-After``). The API's own errors
(``api.core.errors.APIError``) are this envelope too."""

from __future__ import annotations

from typing import Any

#: The ``code`` of an error that names none, by status.
DEFAULT_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "file_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    429: "quota_exceeded",
    431: "request_header_too_large",
    499: "client_closed_request",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout",
    507: "insufficient_storage",
}


class ServingError(Exception):
    """An error answered with ``status_code`` and the OpenAI envelope; raise it anywhere in a request."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code if code is not None else DEFAULT_CODES.get(status_code)
        self.type = type or ("server_error" if status_code >= 500 else "invalid_request_error")
        self.headers = dict(headers or {})
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        err.update(self.extra)
        return {"error": err}

    @classmethod
    def from_body(cls, status_code: int, body: object, headers: dict[str, str]) -> ServingError:
        """The error another process answered (its envelope, status and ``Retry-After``) raised here."""
        err = body.get("error") if isinstance(body, dict) else None
        if not isinstance(err, dict):
            return cls(502, f"The inference server answered {status_code}", code="inference_backend_error")

        def text(key: str) -> str | None:
            value = err.get(key)
            return value if isinstance(value, str) else None

        kept = {k: v for k, v in headers.items() if k.lower() == "retry-after"}
        return cls(
            status_code,
            text("message") or f"The inference server answered {status_code}",
            param=text("param"),
            code=text("code"),
            type=text("type"),
            headers=kept,
        )


#: ``Retry-After`` of an upstream (vLLM, the serving process) that cannot be reached.
UNAVAILABLE_RETRY_AFTER_SECONDS = 5


def backend_unavailable(detail: str) -> ServingError:
    """503 ``inference_backend_unavailable``: an upstream that did not answer, with ``Retry-After``."""
    return ServingError(
        503,
        f"The inference server is unavailable: {detail}",
        code="inference_backend_unavailable",
        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_SECONDS)},
    )

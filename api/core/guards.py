"""Request guards that hold for every route: bounded request headers and ids that cannot exist.

- :class:`HeaderLimitMiddleware`: at most ``max_count`` header fields and ``max_bytes`` of them
  (431 ``request_header_too_large``). The HTTP server bounds the bytes it buffers before the app runs
  (uvicorn's h11 ``max_incomplete_event_size``, see :mod:`api.server`); this checks the parsed list,
  so the limits hold under any server, and bounds the count, which no server option does.
- :func:`no_nul_in_ids`: a NUL byte in a path id answers 404, like any id that does not exist (one
  answer on every database: PostgreSQL refuses NUL in text, SQLite stores it), and in a query
  parameter 400 naming it. Runs after authentication, so an anonymous caller still gets 401.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Query, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from api.core.deps import TeamDep
from api.core.errors import APIError, not_found

#: What a path parameter names, for the 404's message.
ID_KINDS = {"file_id": "File", "fine_tuning_job_id": "fine-tuning job"}
#: ``after``, the pagination cursor of the list routes: the id of the last object of the previous page.
#: The pattern documents in the schema what :func:`no_nul_in_ids` refuses (a NUL byte).
AfterCursor = Annotated[
    str | None,
    Query(pattern=r"^[^\x00]*$", description="The id of the last object of the previous page"),
]


class HeaderLimitMiddleware:
    def __init__(self, app: ASGIApp, *, max_count: int, max_bytes: int) -> None:
        self.app = app
        self.max_count = max_count
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope.get("headers", ())
            problem = None
            if len(headers) > self.max_count:
                problem = f"{len(headers)} header fields, over the server's limit of {self.max_count}"
            else:
                size = sum(len(k) + len(v) + 4 for k, v in headers)  # "name: value\r\n"
                if size > self.max_bytes:
                    problem = f"{size} bytes of headers, over the server's limit of {self.max_bytes}"
            if problem is not None:
                err = APIError(
                    431,
                    f"Request headers too large: {problem}",
                    code="request_header_too_large",
                    headers={"Connection": "close"},
                )
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _shown(value: str) -> str:
    return value.replace("\x00", "\\x00")


async def no_nul_in_ids(request: Request, _team: TeamDep) -> None:
    """Router dependency: ids with a NUL byte are refused before any database sees them."""
    for name, value in request.path_params.items():
        if isinstance(value, str) and "\x00" in value:
            raise not_found(ID_KINDS.get(name, "object"), _shown(value), param=name)
    for name, value in request.query_params.multi_items():
        if "\x00" in value or "\x00" in name:
            raise APIError(
                400,
                f"Invalid {_shown(name)}: NUL bytes are not allowed",
                param=_shown(name),
                code="invalid_value",
            )

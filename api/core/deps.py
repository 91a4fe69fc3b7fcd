"""Request dependencies: the settings, the calling team, and running database work off the event loop.

Endpoints are ``async def`` and do all their database work in one ``run_db`` call: one threadpool
hop per request (a sync dependency or a sync endpoint would each cost a hop, and FastAPI validates a
sync endpoint's response in yet another), with a session that is opened, used and closed in that
same worker thread, so no pooled connection is ever held across requests or idle in a transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Concatenate, ParamSpec, TypeVar

import anyio.to_thread
from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api.core.auth import Principal, authenticate, hash_key, parse_bearer, well_formed
from api.core.config import ApiSettings
from api.core.errors import APIError
from store.settings import Settings

P = ParamSpec("P")
R = TypeVar("R")


async def run_db(
    request: Request, fn: Callable[Concatenate[Session, P], R], /, *args: P.args, **kwargs: P.kwargs
) -> R:
    """``fn(session, *args, **kwargs)`` in the threadpool with a fresh session, closed in that thread."""
    state = request.app.state
    maker = state.sessionmaker

    def call() -> R:
        with maker() as session:
            return fn(session, *args, **kwargs)

    return await anyio.to_thread.run_sync(call, limiter=state.db_limiter)


async def get_settings_dep(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_api_settings_dep(request: Request) -> ApiSettings:
    settings: ApiSettings = request.app.state.api_settings
    return settings


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
ApiSettingsDep = Annotated[ApiSettings, Depends(get_api_settings_dep)]


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


#: Declares the scheme in the OpenAPI schema (``bearerAuth`` on every route that needs a key); the
#: header itself is parsed by ``parse_bearer`` so that every refusal answers our 401.
bearer_auth = HTTPBearer(
    auto_error=False,
    scheme_name="bearerAuth",
    bearerFormat="zf-<43 URL-safe characters>",
    description="A team's API key (`zenflow keys create --team NAME`): `Authorization: Bearer zf-...`",
)


async def current_team(
    request: Request, _scheme: Annotated[HTTPAuthorizationCredentials | None, Security(bearer_auth)]
) -> Principal:
    """The caller's team from ``Authorization: Bearer zf-...``: from the app's key cache, else one
    indexed query in the threadpool (which also refreshes ``last_used_at`` when it is due)."""
    key = parse_bearer(request.headers.get("authorization"))
    if key is None:
        raise _unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer zf-...'.")
    principal: Principal | None = None
    if well_formed(key):
        state = request.app.state
        digest = hash_key(key)
        principal = state.key_cache.get(digest)
        if principal is None:
            principal = await run_db(
                request, authenticate, key, touch_seconds=state.api_settings.key_touch_seconds, digest=digest
            )
            if principal is not None:
                state.key_cache.put(digest, principal)
    if principal is None:
        shown = key[:6] + "*" * 4 if len(key) > 6 else "****"
        raise _unauthorized(f"Incorrect API key provided: {shown}.")
    return principal


TeamDep = Annotated[Principal, Depends(current_team)]

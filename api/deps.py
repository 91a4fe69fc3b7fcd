"""Request dependencies: the database session, the settings and the calling team."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from api.auth import Principal, authenticate, parse_bearer
from api.config import ApiSettings
from api.errors import APIError
from store.settings import Settings


def get_session(request: Request) -> Iterator[Session]:
    session: Session = request.app.state.sessionmaker()
    try:
        yield session
    finally:
        session.close()


def get_settings_dep(request: Request) -> Settings:
    return request.app.state.settings


def get_api_settings_dep(request: Request) -> ApiSettings:
    return request.app.state.api_settings


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
ApiSettingsDep = Annotated[ApiSettings, Depends(get_api_settings_dep)]


def current_team(request: Request, session: SessionDep) -> Principal:
    key = parse_bearer(request.headers.get("authorization"))
    if key is None:
        raise APIError(
            401,
            "You didn't provide an API key. Send it as 'Authorization: Bearer zf-...'.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    principal = authenticate(session, key, touch_seconds=request.app.state.api_settings.key_touch_seconds)
    if principal is None:
        shown = key[:6] + "*" * 4 if len(key) > 6 else "****"
        raise APIError(
            401,
            f"Incorrect API key provided: {shown}.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    # End the read transaction: a long upload must not hold a pooled connection idle in a transaction.
    session.commit()
    return principal


TeamDep = Annotated[Principal, Depends(current_team)]

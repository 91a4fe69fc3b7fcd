"""Per-team API keys: ``zf-`` + 43 random URL-safe characters, stored as a SHA-256 digest.

The first characters (the prefix) are kept in clear to find the row and to tell keys apart in
listings; the key itself is printed once, when it is created, and never stored.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from store.models import ApiKey, Team, utcnow

KEY_PREFIX = "zf-"
PREFIX_LEN = 11  # "zf-" and 8 random characters


@dataclass(frozen=True)
class Principal:
    """Who is calling: the team every query is scoped to."""

    team_id: str
    team_name: str
    key_id: str


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


class TeamExistsError(ValueError):
    pass


class TeamNotFoundError(LookupError):
    pass


def create_team(session: Session, name: str) -> Team:
    name = name.strip()
    if not name:
        raise ValueError("team name must not be empty")
    if session.scalar(select(Team).where(Team.name == name)) is not None:
        raise TeamExistsError(f"team {name!r} already exists")
    team = Team(name=name)
    session.add(team)
    session.flush()
    return team


def find_team(session: Session, name_or_id: str) -> Team:
    team = session.scalar(select(Team).where((Team.name == name_or_id) | (Team.id == name_or_id)))
    if team is None:
        raise TeamNotFoundError(f"no team named {name_or_id!r}")
    return team


def create_key(session: Session, team: Team, name: str = "") -> tuple[ApiKey, str]:
    """A new key row and the clear key (show it once)."""
    key = generate_key()
    row = ApiKey(team_id=team.id, name=name, prefix=key[:PREFIX_LEN], key_hash=hash_key(key))
    session.add(row)
    session.flush()
    return row, key


def revoke_key(session: Session, key_id_or_prefix: str) -> ApiKey:
    row = session.scalar(
        select(ApiKey).where((ApiKey.id == key_id_or_prefix) | (ApiKey.prefix == key_id_or_prefix))
    )
    if row is None:
        raise LookupError(f"no key {key_id_or_prefix!r}")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
    return row


def parse_bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    token = token.strip()
    return token or None


def authenticate(session: Session, key: str, *, touch_seconds: float = 60.0) -> Principal | None:
    """The principal of a valid, unrevoked key, else None (constant-time digest comparison)."""
    if not key.startswith(KEY_PREFIX) or len(key) < PREFIX_LEN + 8 or len(key) > 200:
        return None
    digest = hash_key(key)
    rows = session.execute(
        select(ApiKey, Team.name)
        .join(Team, Team.id == ApiKey.team_id)
        .where(ApiKey.prefix == key[:PREFIX_LEN])
    ).all()
    for row, team_name in rows:
        if hmac.compare_digest(row.key_hash, digest) and row.revoked_at is None:
            now = utcnow()
            last = row.last_used_at
            if last is not None and last.tzinfo is None:
                last = last.replace(tzinfo=now.tzinfo)
            if last is None or now - last > timedelta(seconds=touch_seconds):
                row.last_used_at = now
                session.commit()
            return Principal(team_id=row.team_id, team_name=team_name, key_id=row.id)
    return None

"""Per-team API keys: ``zf-`` + 43 random URL-safe characters, stored as a SHA-256 digest.

The first characters (the prefix) are kept in clear to find the row and to tell keys apart in
listings; the key itself is printed once, when it is created, and never stored.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import event, select
from sqlalchemy.orm import Session

from store.orm import ApiKey, Team, as_utc, utcnow

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
    """Mark a key revoked (the caller commits). This process's key caches forget it at once and again
    after the commit; other processes' caches within ``key_cache_seconds``."""
    row = session.scalar(
        select(ApiKey).where((ApiKey.id == key_id_or_prefix) | (ApiKey.prefix == key_id_or_prefix))
    )
    if row is None:
        raise LookupError(f"no key {key_id_or_prefix!r}")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
    key_id = row.id
    forget_key(key_id)
    event.listen(session, "after_commit", lambda _s: forget_key(key_id), once=True)
    return row


def parse_bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    token = token.strip()
    return token or None


def well_formed(key: str) -> bool:
    return key.startswith(KEY_PREFIX) and PREFIX_LEN + 8 <= len(key) <= 200


def authenticate(
    session: Session, key: str, *, touch_seconds: float = 60.0, digest: str | None = None
) -> Principal | None:
    """The principal of a valid, unrevoked key, else None (constant-time digest comparison).

    One indexed query (by prefix, joined to the team); ``last_used_at`` is written (and committed)
    only when it is older than ``touch_seconds``.
    """
    if not well_formed(key):
        return None
    digest = digest or hash_key(key)
    rows = session.execute(
        select(ApiKey, Team.name)
        .join(Team, Team.id == ApiKey.team_id)
        .where(ApiKey.prefix == key[:PREFIX_LEN])
    ).all()
    for row, team_name in rows:
        if hmac.compare_digest(row.key_hash, digest) and row.revoked_at is None:
            now = utcnow()
            last = as_utc(row.last_used_at)
            if last is None or now - last > timedelta(seconds=touch_seconds):
                row.last_used_at = now
                session.commit()
            return Principal(team_id=row.team_id, team_name=team_name, key_id=row.id)
    return None


class KeyCache:
    """Principals of keys authenticated in the last ``ttl`` seconds, by key digest.

    Saves the key lookup on every request. Only successes are kept (a key created a moment ago works
    at once); a revocation in this process (``revoke_key``) evicts the key immediately, one made
    elsewhere (another replica, the CLI) is honoured within ``ttl``. ``ttl`` 0 disables the cache.
    """

    def __init__(self, ttl: float, max_entries: int = 10_000) -> None:
        self.ttl = float(ttl)
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, Principal]] = {}
        self._lock = threading.Lock()
        _CACHES.add(self)

    def get(self, digest: str) -> Principal | None:
        if self.ttl <= 0:
            return None
        hit = self._entries.get(digest)
        if hit is None:
            return None
        expires, principal = hit
        if time.monotonic() >= expires:
            with self._lock:
                self._entries.pop(digest, None)
            return None
        return principal

    def put(self, digest: str, principal: Principal) -> None:
        if self.ttl <= 0:
            return
        with self._lock:
            if len(self._entries) >= self.max_entries:
                now = time.monotonic()
                self._entries = {d: e for d, e in self._entries.items() if e[0] > now}
                if len(self._entries) >= self.max_entries:
                    self._entries.clear()
            self._entries[digest] = (time.monotonic() + self.ttl, principal)

    def forget(self, key_id: str | None = None) -> None:
        """Drop one key's entries (by key id), or all of them."""
        with self._lock:
            if key_id is None:
                self._entries.clear()
            else:
                self._entries = {d: e for d, e in self._entries.items() if e[1].key_id != key_id}


_CACHES: weakref.WeakSet[KeyCache] = weakref.WeakSet()


def forget_key(key_id: str | None = None) -> None:
    """Evict a key (or every key) from all key caches of this process."""
    for cache in list(_CACHES):
        cache.forget(key_id)

"""Settings of the HTTP service itself (env prefix ``ZENFLOW_API_``); shared ones live in store.settings."""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ApiSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZENFLOW_API_", env_file=".env", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    #: Run ``alembic upgrade head`` when the app starts (one replica at a time: PostgreSQL advisory lock).
    migrate_on_start: bool = True
    #: How often an event stream polls the database for new events.
    stream_poll_seconds: float = Field(0.5, gt=0)
    #: A comment line is sent on an idle event stream this often, so proxies keep it open.
    stream_keepalive_seconds: float = Field(15.0, gt=0)
    #: ``api_keys.last_used_at`` is refreshed at most this often per key (it is a write per request).
    key_touch_seconds: float = Field(60.0, ge=0)
    #: An authenticated key is remembered this long (no database lookup per request); a key revoked in
    #: another process is refused after at most this long (0 = look every key up on every request).
    key_cache_seconds: float = Field(5.0, ge=0)
    #: Requests doing database work at once (threads; the others wait without a thread). 0 = the size
    #: of the engine's connection pool, so no request waits for, or churns, an overflow connection.
    db_threads: int = Field(0, ge=0)
    #: After start, move the startup heap out of the cyclic GC's reach (``gc.freeze``), so its full
    #: collections (~100 ms on a small machine) stop pausing requests.
    gc_freeze: bool = True
    #: Largest request body other than a file upload (uploads have ZENFLOW_MAX_UPLOAD_BYTES); larger
    #: ones are answered 413 ``request_too_large`` before they are parsed.
    max_body_bytes: int = Field(1024 * 1024, gt=0)
    #: Timeout of the broker probe in /readyz.
    readiness_timeout_seconds: float = Field(2.0, gt=0)


@lru_cache(maxsize=1)
def get_api_settings() -> ApiSettings:
    return ApiSettings()

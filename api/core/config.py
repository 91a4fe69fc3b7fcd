"""Settings of the HTTP service itself (env prefix ``ZENFLOW_API_``); shared ones live in store.settings."""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from serving.config import ServingSettings


class ApiSettings(ServingSettings):
    """The API process's settings: its own, and the inference ones (``serving.config``): it runs the
    built-in backend itself unless ``inference_server_url`` names a serving process."""

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
    #: Each /readyz check (the database, the broker) answers within this; both run at once.
    readiness_timeout_seconds: float = Field(2.0, gt=0)
    #: Request line plus headers, in bytes: uvicorn (h11) stops buffering an incomplete request head
    #: past this (answering 400 and closing), and the app refuses larger header lists with 431 (a head
    #: that arrived whole in one read). The compose deployment's proxy (deploy/nginx) refuses heads
    #: over 16 KiB itself; the compose file sets this above that, so what it passes on is taken.
    max_header_bytes: int = Field(16 * 1024, ge=1024)
    #: Header fields per request; more are answered 431.
    max_header_count: int = Field(100, ge=8)
    #: An idle keep-alive connection is closed after this long (uvicorn); the proxy's upstream
    #: keep-alive is shorter, so it never reuses a connection the API is closing.
    keep_alive_seconds: int = Field(5, ge=1)
    #: Upload temp files (``files_dir/.incoming/*.part``) untouched this long are left over from a
    #: killed API process and removed when the API starts; younger ones may be another replica's
    #: upload in progress (the temp file is written to as the body streams in) and are kept.
    stale_upload_seconds: float = Field(3600.0, gt=0)
    #: Storage retention: a finished job keeps its newest ``retain_checkpoints`` checkpoints plus its
    #: final model; older ones are removed by the retention sweep (api.retention), which the API runs
    #: every ``retention_interval_seconds`` (0: never; ``zenflow storage sweep`` runs it once).
    retain_checkpoints: int = Field(3, ge=0)
    #: Built-in models' weights written for download at a seed (``data_dir/builtin-models``,
    #: api.builtin_cache) are kept within this many bytes, the least recently used removed first.
    builtin_cache_bytes: int = Field(1024**3, ge=0)
    retention_interval_seconds: float = Field(3600.0, ge=0)


@lru_cache(maxsize=1)
def get_api_settings() -> ApiSettings:
    return ApiSettings()

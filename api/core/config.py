"""Settings of the HTTP service itself (env prefix ``ZENFLOW_API_``); shared ones live in store.settings."""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import Field, model_validator
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

    # --- inference (/v1/chat/completions, /v1/completions; api.inference) ---
    #: ``builtin``: transformers ``generate`` in this process; ``vllm``: forward to ``inference_vllm_url``
    #: the models vLLM serves (LoRA adapters loaded per model id), the others stay built-in.
    inference_backend: Literal["builtin", "vllm"] = "builtin"
    inference_vllm_url: str = ""
    #: Requests forwarded to vLLM at once (it batches and queues them itself); more: 429.
    inference_vllm_max_requests: int = Field(64, ge=1)
    #: Decode threads of the built-in backend (models decoding at once; the requests for one model are
    #: decoded together), and the requests admitted beyond them: ``inference_threads +
    #: inference_queue_size`` admission slots, of which each of the T teams asking may hold
    #: ceil(slots / T); more: 429 (api.inference.team_shares).
    inference_threads: int = Field(1, ge=1, le=64)
    inference_queue_size: int = Field(8, ge=0)
    #: Choices (rows) decoded together in one forward pass per model; a request's choices beyond the
    #: room left join as rows finish.
    inference_batch_rows: int = Field(16, ge=1, le=1024)
    #: How long a decode thread stays on one model while another model waits for a thread (its batch
    #: parked, resumed at its next turn; api.inference.batcher): what a request to another model waits
    #: per model ahead of it.
    inference_slice_seconds: float = Field(0.2, gt=0, le=60)
    #: ``Retry-After`` of that 429.
    inference_retry_after_seconds: float = Field(2.0, gt=0)
    #: Per request: prompts in a ``/v1/completions`` list, tokens of one prompt (chat: the rendered
    #: conversation), tokens of all its prompts, and completion tokens it may ask for, prompts x ``n`` x
    #: ``max_tokens`` (without ``max_tokens`` its default shrinks to fit). Over one: 400 naming the field,
    #: the counts checked before admission, the tokens as the prompts are encoded (stopping at the first over).
    inference_max_prompts: int = Field(64, ge=1)
    inference_max_prompt_tokens: int = Field(8192, ge=1)
    inference_max_request_prompt_tokens: int = Field(32768, ge=1)
    inference_max_request_tokens: int = Field(16384, ge=1)
    #: A request (waiting included) ends with 504 / a stream error after this long, its generation stopped.
    inference_timeout_seconds: float = Field(300.0, gt=0)
    #: Loaded models kept (least recently used dropped first), and their memory budget in bytes.
    inference_max_models: int = Field(2, ge=1)
    inference_memory_bytes: int = Field(8 * 1024**3, gt=0)
    #: ``auto``: the first GPU when there is one, else the CPU; dtype ``auto``: bf16/fp16 on a GPU, fp32 on the CPU.
    inference_device: str = "auto"
    inference_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    #: Largest ``max_tokens`` a request may ask for (and the default cap when it gives none).
    inference_max_tokens: int = Field(2048, ge=1)

    @model_validator(mode="after")
    def _vllm_needs_its_url(self) -> ApiSettings:
        if self.inference_backend == "vllm" and not self.inference_vllm_url:
            raise ValueError("inference_vllm_url is required with inference_backend=vllm")
        return self


@lru_cache(maxsize=1)
def get_api_settings() -> ApiSettings:
    return ApiSettings()

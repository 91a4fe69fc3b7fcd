"""Service settings from the environment (prefix ``ZENFLOW_``), with embedded defaults."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZENFLOW_", env_file=".env", extra="ignore")

    #: Root of everything the service writes by default (SQLite files, uploads, job outputs).
    data_dir: Path = Path("var")
    #: SQLAlchemy URL; empty means the embedded SQLite file under data_dir.
    database_url: str = ""
    #: Celery broker URL; empty means kombu's SQLAlchemy transport on a SQLite file under data_dir.
    broker_url: str = ""
    #: Where uploaded files are stored (default data_dir/files).
    files_dir: Path | None = None
    #: Where job outputs and checkpoints go (default data_dir/jobs).
    jobs_dir: Path | None = None

    max_upload_bytes: int = Field(512 * 1024 * 1024, gt=0)
    #: A job whose worker died is re-queued and resumed at most this many times in all.
    max_job_attempts: int = Field(3, ge=1)
    #: Must exceed the longest job, or Redis redelivers a running job to a second worker.
    broker_visibility_timeout_seconds: int = Field(7 * 24 * 3600, gt=0)
    #: A running job whose worker has not sent a heartbeat for this long is considered lost.
    heartbeat_timeout_seconds: float = Field(120.0, gt=0)
    heartbeat_interval_seconds: float = Field(10.0, gt=0)
    #: A queued job whose message was not handed to the broker this long after its creation (the API
    #: died between commit and enqueue), or whose message was handed over longer ago than this and is
    #: no longer in the broker (Redis restarted without persistence, flushed), is dispatched again by
    #: the reaper (trainer.worker.dispatch). Covers the moment a worker holds a message it has not claimed yet.
    dispatch_grace_seconds: float = Field(30.0, gt=0)
    #: Celery queue for jobs that name no GPU kind.
    default_queue: str = "gpu-default"
    #: Port of a worker's Prometheus endpoint (0 disables it); `python -m trainer.worker` gives its i-th GPU worker port + i.
    worker_metrics_port: int = Field(0, ge=0, le=65535)
    #: Name of this worker in metrics labels (default: hostname).
    worker_name: str = ""

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'zenflow.db').resolve()}"

    @property
    def resolved_broker_url(self) -> str:
        return self.broker_url or f"sqla+sqlite:///{(self.data_dir / 'broker.db').resolve()}"

    @property
    def resolved_files_dir(self) -> Path:
        return (self.files_dir or self.data_dir / "files").resolve()

    @property
    def resolved_jobs_dir(self) -> Path:
        return (self.jobs_dir or self.data_dir / "jobs").resolve()

    @property
    def embedded(self) -> bool:
        """True when no external broker is configured (the one-command embedded default)."""
        return not self.broker_url


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()

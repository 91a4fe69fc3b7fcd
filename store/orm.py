"""ORM models (SQLAlchemy 2.0 typed declarative). Alembic revisions in migrations/ mirror these."""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from contract.job import RESOLUTIONS, JobRequest, Resolution
from store.ids import new_id

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(dt: datetime | None) -> datetime | None:
    """``dt`` as an aware UTC datetime (SQLite hands timestamps back naive; PostgreSQL aware)."""
    return dt.replace(tzinfo=UTC) if dt is not None and dt.tzinfo is None else dt


class RequestJSON(TypeDecorator[JobRequest]):
    """A job's request (contract.job.JobRequest) as JSON: what it gave only (unset fields stay unset, so
    a resolution can tell a value asked for from a default), validated by the contract when read."""

    impl = JSON
    cache_ok = True

    def process_bind_param(self, value: JobRequest | None, dialect: Any) -> Any:
        return None if value is None else value.model_dump(mode="json", exclude_unset=True)

    def process_result_value(self, value: Any, dialect: Any) -> JobRequest | None:
        return None if value is None else JobRequest.model_validate(value)


class ResolutionsJSON(TypeDecorator[list[Resolution]]):
    """A job's resolutions (contract.job.Resolution, the last one current) as JSON, validated by the
    contract when read."""

    impl = JSON
    cache_ok = True

    def process_bind_param(self, value: list[Resolution] | None, dialect: Any) -> Any:
        return [] if value is None else RESOLUTIONS.dump_python(value, mode="json")

    def process_result_value(self, value: Any, dialect: Any) -> list[Resolution]:
        return [] if value is None else RESOLUTIONS.validate_python(value)


def _bare_request(context: Any) -> JobRequest:
    """The request of a row inserted without one: its model and files, every setting left unset (a
    create always writes the request it was given)."""
    row = context.get_current_parameters()
    return JobRequest(
        model=row["model"],
        training_file=row["training_file_id"],
        validation_file=row.get("validation_file_id"),
    )


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSON, datetime: DateTime(timezone=True)}


class JobStatus(enum.StrEnum):
    validating_files = "validating_files"
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    #: Stopped on a user's request (``POST .../pause``), its checkpoint kept: neither waiting nor running
    #: (no worker claims it, no quota counts it) until a resume puts it back in its queue. Not terminal.
    paused = "paused"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled)


class Team(Base):
    __tablename__ = "teams"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("team"))
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    api_keys: Mapped[list[ApiKey]] = relationship(back_populates="team", cascade="all, delete-orphan")


class ApiKey(Base):
    """An API key, stored as a SHA-256 digest; the prefix finds the row without scanning."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("key"))
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    prefix: Mapped[str] = mapped_column(String(16), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(default=None)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)

    team: Mapped[Team] = relationship(back_populates="api_keys")


class File(Base):
    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("file"))
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"), index=True)
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    storage_path: Mapped[str] = mapped_column(Text)
    #: Number of examples found by the validator.
    num_examples: Mapped[int] = mapped_column(Integer, default=0)
    status: Mapped[str] = mapped_column(String(32), default="processed")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    #: Outcomes of checking the data with a model's tokenizer, by check key (api.jobs.data_check): an
    #: upload with ``model`` or a job's create keeps it, a later create with the same key reuses it.
    data_checks: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class FineTuningJob(Base):
    __tablename__ = "fine_tuning_jobs"
    __table_args__ = (
        UniqueConstraint("team_id", "idempotency_key", name="uq_fine_tuning_jobs_team_idempotency"),
        Index("ix_fine_tuning_jobs_team_created", "team_id", "created_at"),
        #: Queue position (waiting jobs of one queue, FIFO) and the dispatch reconciler's per-queue scan.
        Index("ix_fine_tuning_jobs_queue_status_created", "queue", "status", "created_at"),
        #: A team's running and waiting jobs (quotas at create, fair share's per-team counts).
        Index("ix_fine_tuning_jobs_team_status", "team_id", "status"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ftjob"))
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"), index=True)
    model: Mapped[str] = mapped_column(String(512))
    training_file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="RESTRICT"))
    validation_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id", ondelete="RESTRICT"))
    status: Mapped[str] = mapped_column(String(32), default=JobStatus.validating_files.value, index=True)
    #: What the client asked: method, hyperparameters, engine, resources (contract.job.JobRequest; the
    #: model and the files are the columns of their own).
    request: Mapped[JobRequest] = mapped_column(RequestJSON, nullable=True, default=_bare_request)
    #: What the job is: its resolutions (contract.job.Resolution), the first made at create, one more each
    #: time a run had to decide again; the last one is current. Empty only for a job created before
    #: resolutions were recorded and not run since (its run resolves it).
    resolutions: Mapped[list[Resolution]] = mapped_column(ResolutionsJSON, nullable=True, default=list)
    #: Tracking integrations as requested (worker.tracking.integrations: ``[{"type": "mlflow", "mlflow": {...}}]``);
    #: NULL: none.
    integrations: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, default=None)
    suffix: Mapped[str | None] = mapped_column(String(64))
    seed: Mapped[int] = mapped_column(BigInteger, default=0)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON, default=None)
    fine_tuned_model: Mapped[str | None] = mapped_column(String(512))
    #: Ids of the files the job produced (``fine-tune-results``: the per-step metrics CSV), once succeeded.
    result_files: Mapped[list[str] | None] = mapped_column(JSON, default=None)
    #: {"code", "message", "param"} once failed.
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    trained_tokens: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)

    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    #: Fingerprint of the create request, so a reused key with a different body is refused.
    request_hash: Mapped[str | None] = mapped_column(String(64))

    queue: Mapped[str] = mapped_column(String(64), default="gpu-default")
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    #: A user asked a running job to pause: its runner stops at the next step, checkpointing there, and
    #: writes ``paused`` (store.jobs.pause clears it). Revision 0014.
    pause_requested: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    global_step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int | None] = mapped_column(Integer)
    output_dir: Mapped[str | None] = mapped_column(Text)
    last_checkpoint_path: Mapped[str | None] = mapped_column(Text)
    worker_hostname: Mapped[str | None] = mapped_column(String(255))
    heartbeat_at: Mapped[datetime | None] = mapped_column(default=None)
    #: When the broker accepted this job's message for its current wait in the queue; NULL while no
    #: message was handed over yet (cleared whenever the job becomes queued). See worker.dispatch.
    dispatched_at: Mapped[datetime | None] = mapped_column(default=None)
    #: A queued job is neither claimed nor dispatched before this time (a job stopped by a full disk
    #: waits off the GPU, worker.requeue); NULL: as soon as a worker is free. Cleared at dispatch.
    not_before: Mapped[datetime | None] = mapped_column(default=None)

    events: Mapped[list[JobEvent]] = relationship(
        back_populates="job", cascade="all, delete-orphan", passive_deletes=True
    )

    @property
    def resolution(self) -> Resolution | None:
        """The current resolution (None: not resolved yet)."""
        return self.resolutions[-1] if self.resolutions else None

    @property
    def world_size(self) -> int:
        """Every rank the job runs on (resources: nodes x gpus)."""
        return self.request.resources.world_size

    checkpoints: Mapped[list[JobCheckpoint]] = relationship(
        back_populates="job", cascade="all, delete-orphan", passive_deletes=True
    )


class JobEvent(Base):
    __tablename__ = "fine_tuning_job_events"
    __table_args__ = (Index("ix_fine_tuning_job_events_job_seq", "job_id", "seq"),)

    #: Monotonic sequence: the order of events and the cursor for pagination and streaming.
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True, default=lambda: new_id("ftevent"))
    job_id: Mapped[str] = mapped_column(ForeignKey("fine_tuning_jobs.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    level: Mapped[str] = mapped_column(String(16), default="info")
    type: Mapped[str] = mapped_column(String(16), default="message")
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)

    job: Mapped[FineTuningJob] = relationship(back_populates="events")


class JobCheckpoint(Base):
    __tablename__ = "fine_tuning_job_checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step_number", name="uq_fine_tuning_job_checkpoints_step"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ftckpt"))
    job_id: Mapped[str] = mapped_column(ForeignKey("fine_tuning_jobs.id", ondelete="CASCADE"), index=True)
    step_number: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    fine_tuned_model_checkpoint: Mapped[str] = mapped_column(String(512))
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    job: Mapped[FineTuningJob] = relationship(back_populates="checkpoints")


class JobStepMetric(Base):
    """One training step's figures, served per job by the API (no job label on Prometheus series)."""

    __tablename__ = "fine_tuning_job_step_metrics"

    job_id: Mapped[str] = mapped_column(
        ForeignKey("fine_tuning_jobs.id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    train_loss: Mapped[float | None] = mapped_column(Float)
    valid_loss: Mapped[float | None] = mapped_column(Float)
    lr: Mapped[float | None] = mapped_column(Float)
    tokens_per_second: Mapped[float | None] = mapped_column(Float)
    step_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    stall_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    stall_fraction: Mapped[float] = mapped_column(Float, default=0.0)
    gpu_utilization: Mapped[float | None] = mapped_column(Float)
    cpu_optimizer_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    bytes_device_to_host: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_host_to_device: Mapped[int] = mapped_column(BigInteger, default=0)
    #: A method's own figures of the step (a reinforcement job's rewards: trainer.events.RewardMetrics
    #: without its examples); NULL for supervised and DPO steps.
    method_metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)


class TeamQuota(Base):
    """A team's own quota limits; a NULL column takes the settings' default (``default_*``, which may
    be unlimited). See store.quotas."""

    __tablename__ = "team_quotas"

    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"), primary_key=True)
    max_running_jobs: Mapped[int | None] = mapped_column(Integer)
    max_queued_jobs: Mapped[int | None] = mapped_column(Integer)
    #: GPU-hours per rolling quota period (``quota_period_days``).
    gpu_hours: Mapped[float | None] = mapped_column(Float)
    storage_bytes: Mapped[int | None] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class JobRun(Base):
    """One attempt of a job on a worker: opened by the claim, ended when the job leaves running.

    The GPU-hours quota sums ``gpus`` x run time over these (an open run counts up to now), and fair
    share orders teams by their last run's start (store.fairshare). Kept when a job row is deleted.
    """

    __tablename__ = "fine_tuning_job_runs"
    __table_args__ = (
        Index("ix_fine_tuning_job_runs_team_queue_started", "team_id", "queue", "started_at"),
        Index("ix_fine_tuning_job_runs_team_ended", "team_id", "ended_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ftrun"))
    job_id: Mapped[str | None] = mapped_column(
        ForeignKey("fine_tuning_jobs.id", ondelete="SET NULL"), index=True
    )
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"))
    queue: Mapped[str] = mapped_column(String(64))
    worker_hostname: Mapped[str | None] = mapped_column(String(255))
    gpus: Mapped[int] = mapped_column(Integer, default=1)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[datetime | None] = mapped_column(default=None)
    #: gpus x (ended_at - started_at), set when the run ends.
    gpu_seconds: Mapped[float | None] = mapped_column(Float)


class JobNode(Base):
    """A worker's node slot in one attempt of a multi-node job (a gang, store.gang): node 0 is the
    rendezvous host (its ``rdzv_endpoint``); the attempt starts once all ``resources.nodes`` slots are
    taken, and a slot whose heartbeat goes stale dissolves its gang."""

    __tablename__ = "fine_tuning_job_nodes"

    job_id: Mapped[str] = mapped_column(
        ForeignKey("fine_tuning_jobs.id", ondelete="CASCADE"), primary_key=True
    )
    #: The attempt the gang forms for: the job's ``attempts`` + 1 while forming, ``attempts`` once started.
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    worker_hostname: Mapped[str] = mapped_column(String(255), index=True)
    #: ``host:port`` of the rendezvous (node 0's slot only).
    rdzv_endpoint: Mapped[str | None] = mapped_column(String(255))
    joined_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    #: When this member's ranks ended cleanly (it no longer beats; node 0 writes the end state).
    left_at: Mapped[datetime | None] = mapped_column(default=None)


class ModelKind(enum.StrEnum):
    fine_tuned = "fine-tuned"
    checkpoint = "checkpoint"


class RegisteredModel(Base):
    """A team's fine-tuned model or checkpoint by its ``ft:`` id, mapped to its files (store.model_ids).

    Registered where the job's result and checkpoints are recorded; ``deleted_at`` once the team deletes it
    (``DELETE /v1/models/{id}``, its files removed) or its files are pruned. The tar checksums are filled in
    by the first download and cleared whenever the row is pointed at other files.
    """

    __tablename__ = "models"
    __table_args__ = (Index("ix_models_team_created", "team_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(512), primary_key=True)
    team_id: Mapped[str] = mapped_column(ForeignKey("teams.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(16))
    job_id: Mapped[str] = mapped_column(ForeignKey("fine_tuning_jobs.id", ondelete="CASCADE"), index=True)
    #: The checkpoint's training step (None for a job's final model).
    step_number: Mapped[int | None] = mapped_column(Integer)
    #: Short name of the base model (built-in name or model-root folder) the job started from.
    base_model: Mapped[str] = mapped_column(String(512))
    #: The folder with config, tokenizer and merged safetensors (from_pretrained).
    path: Mapped[str] = mapped_column(Text)
    #: LoRA runs: the peft adapter folder.
    adapter_path: Mapped[str | None] = mapped_column(Text)
    #: SHA-256 of the download tars (model, adapter), cached by the first download.
    content_sha256: Mapped[str | None] = mapped_column(String(64))
    adapter_sha256: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(default=None)


class Worker(Base):
    """A worker process of the service and what it can run (store.worker_registry): registered at its start
    with the capacity it measured, its heartbeat refreshed while it runs; the API admits a job only
    when its plan fits a live worker of the job's queue."""

    __tablename__ = "workers"

    #: The worker's Celery node name (``gpu0@host``), what a running job records in ``worker_hostname``.
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    #: The queues it consumes.
    queues: Mapped[list[str]] = mapped_column(JSON, default=list)
    #: What it measured at start (worker.capacity.measure.WorkerCapacity fields).
    capacity: Mapped[dict[str, Any]] = mapped_column(default=dict)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    #: Ranks (GPUs) per job it runs (``--gpus-per-job``): the size of the jobs of the queue it consumes.
    gpus_per_job: Mapped[int] = mapped_column(Integer, default=1, server_default=text("1"))

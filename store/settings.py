"""Service settings from the environment (prefix ``ZENFLOW_``), with embedded defaults."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

#: The base models shipped in the package's data (``trainer/samples/models``; a path, not an import: the
#: store knows no trainer module).
SHIPPED_MODELS_DIR = Path(__file__).resolve().parents[1] / "trainer" / "samples" / "models"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZENFLOW_", env_file=".env", extra="ignore")

    #: Root of everything the service writes by default (SQLite files, uploads, job outputs).
    data_dir: Path = Path("var")
    #: SQLAlchemy URL; empty means the embedded SQLite file under data_dir.
    database_url: str = ""
    #: Every wait on PostgreSQL is bounded (store.db): a new connection's connect and login (libpq's
    #: minimum is 2 s); each network operation on an open one (a statement, a commit), after which the
    #: connection is dropped and the caller gets an error (the API: 503 ``database_unavailable``) instead
    #: of waiting on a database that accepts bytes and never answers; the liveness check of a pooled
    #: connection before it is handed out (a dead one is replaced); a wait for a free pooled connection.
    #: Schema migrations run without the operation bound (a long ALTER, the lock between replicas).
    database_connect_timeout_seconds: int = Field(3, ge=2)
    database_operation_timeout_seconds: float = Field(10.0, gt=0)
    database_ping_timeout_seconds: float = Field(2.0, gt=0)
    database_pool_timeout_seconds: float = Field(5.0, gt=0)
    #: Celery broker URL; empty means kombu's SQLAlchemy transport on a SQLite file under data_dir.
    broker_url: str = ""
    #: Where uploaded files are stored (default data_dir/files).
    files_dir: Path | None = None
    #: Where job outputs and checkpoints go (default data_dir/jobs).
    jobs_dir: Path | None = None
    #: Folders of base models a job may name (``ZENFLOW_MODEL_ROOTS``: paths separated by ``:``, or a JSON
    #: list); a model is named by its folder relative to a root, e.g. ``Qwen/Qwen2.5-0.5B`` (store.model_ids).
    #: Default: the bases shipped with the package (the demo's ``docs-llama``, a base that knows some
    #: language), so a fresh install offers one; set roots replace it (add it to them to keep it).
    model_roots: Annotated[list[Path], NoDecode] = Field(default_factory=lambda: [SHIPPED_MODELS_DIR])

    max_upload_bytes: int = Field(512 * 1024 * 1024, gt=0)
    #: A job whose worker died is re-queued and resumed at most this many times in all.
    max_job_attempts: int = Field(3, ge=1)
    #: Must exceed the longest job, or Redis redelivers a running job to a second worker.
    broker_visibility_timeout_seconds: int = Field(7 * 24 * 3600, gt=0)
    #: A running job whose worker has not sent a heartbeat for this long is considered lost.
    heartbeat_timeout_seconds: float = Field(120.0, gt=0)
    heartbeat_interval_seconds: float = Field(10.0, gt=0)
    #: A multi-node job's gang (store.gang) must have all its nodes joined this long after its first
    #: member took node 0, or its members release their slots and the job waits its turn again (no
    #: attempt counted, its queue position kept): a partial gang never holds workers for long.
    gang_form_timeout_seconds: float = Field(120.0, gt=0)
    #: The address the other workers of a gang reach this worker's rendezvous at, when it is node 0
    #: (default: the host's name); 127.0.0.1 for several workers on one machine.
    worker_address: str = ""
    #: A queued job whose message was not handed to the broker this long after its creation (the API
    #: died between commit and enqueue), or whose message was handed over longer ago than this and is
    #: no longer in the broker (Redis restarted without persistence, flushed), is dispatched again by
    #: the reaper (worker.dispatch). Covers the moment a worker holds a message it has not claimed yet.
    dispatch_grace_seconds: float = Field(30.0, gt=0)
    #: Celery queue for jobs that name no GPU kind.
    default_queue: str = "gpu-default"
    #: Port of a worker's Prometheus endpoint (0 disables it); `python -m worker` gives its i-th GPU worker port + i.
    worker_metrics_port: int = Field(0, ge=0, le=65535)
    #: A folder where `python -m worker` writes its processes' /metrics endpoints as a Prometheus
    #: file_sd file (worker.targets), removed when it stops; "" writes none.
    worker_targets_dir: str = ""
    #: Name of this worker in metrics labels and the host part of its Celery node name (default: hostname).
    worker_name: str = ""
    #: How long a job process keeps training while its database writes fail (its rows wait in memory,
    #: written in order once the database is back); longer, and the job stops as interrupted: it
    #: checkpoints, exits, and is re-queued (the attempt counted) to resume from its checkpoint.
    job_db_outage_seconds: float = Field(300.0, gt=0)
    #: At most this many training events (about 2 KB each) wait in a job process's memory for the
    #: database; when full, training waits for it (bounded memory over any number of steps).
    job_db_buffer_items: int = Field(20_000, ge=1)
    #: A job stopped by a full disk is re-queued after this long without counting an attempt (doubled for
    #: each such re-queue in a row, at most 15 minutes) ...
    disk_full_backoff_seconds: float = Field(60.0, ge=0)
    #: ... and fails after this many re-queues in a row without a new checkpoint in between.
    disk_full_max_requeues: int = Field(5, ge=0)

    # --- bounds of one job, checked at create (trainer.limits.JobLimits; 400 naming the field) ---
    max_n_epochs: int = Field(10_000, ge=1, le=2**31 - 1)
    max_batch_size: int = Field(4096, ge=1, le=2**31 - 1)
    #: Shortest max_seq_length a job may give (shorter cannot hold a chat template and one exchange).
    min_seq_length: int = Field(32, ge=2, le=2**31 - 1)
    max_seq_length: int = Field(32_768, ge=2, le=2**31 - 1)
    #: Training steps of one job, counted from its training file (n_epochs x steps per epoch, or max_steps).
    max_total_steps: int = Field(1_000_000, ge=1, le=2**31 - 1)
    #: Token positions of one job: total steps x batch size x max_seq_length.
    max_total_tokens: int = Field(100_000_000_000, ge=1)
    #: Largest learning rate (hyperparameters.learning_rate, or the model's rate x learning_rate_multiplier).
    max_learning_rate: float = Field(1.0, gt=0, allow_inf_nan=False)
    max_lora_rank: int = Field(256, ge=1, le=65_536)
    #: Bounds of one example of a job's data (trainer.limits: messages, characters of its line, tokens
    #: before truncation); over one, the upload or the create is a 400 naming the line.
    max_example_messages: int = Field(2048, ge=1, le=2**31 - 1)
    max_example_chars: int = Field(2_000_000, ge=1, le=2**31 - 1)
    max_example_tokens: int = Field(262_144, ge=1, le=2**31 - 1)
    #: A data check with a model's tokenizer (at create, and at upload with ``model``) runs in one of
    #: this many processes (api.jobs.check_pool) ...
    data_check_workers: int = Field(2, ge=1, le=64)
    #: ... and is refused (400 ``data_check_timeout``) when it has not finished this long after it
    #: started waiting for one (under the proxy's 300 s read timeout).
    data_check_timeout_seconds: float = Field(240.0, gt=0, allow_inf_nan=False)
    # --- per-team quotas (store.quotas): defaults for teams without their own (None = unlimited) ---
    default_max_running_jobs: int | None = Field(None, ge=0)
    default_max_queued_jobs: int | None = Field(None, ge=0)
    #: GPU-hours a team may use per rolling quota period (run time x GPUs of every attempt).
    default_gpu_hours: float | None = Field(None, ge=0, allow_inf_nan=False)
    default_storage_bytes: int | None = Field(None, ge=0)
    #: The rolling window the GPU-hours quota counts, in days.
    quota_period_days: float = Field(30.0, gt=0, le=3660)
    #: A worker whose message finds only jobs of teams at their max_running_jobs waiting re-checks for
    #: this long (once a second) before it hands the message back to the queue.
    quota_hold_seconds: float = Field(30.0, ge=0)
    # --- workers and admission (store.worker_registry, api.jobs.admission) ---
    #: Ranks (GPUs) per job this worker runs (``python -m worker --gpus-per-job N``); it consumes
    #: the queue of jobs of that size (worker.broker.queue_for_gpus).
    gpus_per_job: int = Field(1, ge=1, le=64)
    #: A worker without GPUs may run a multi-rank job as gloo ranks on the CPU (demo and tests).
    cpu_ranks: bool = False
    #: Whether a job's ranks fork from the worker's process template (trainer.run.template: torch and
    #: the trainer imported once) instead of each importing them anew: "auto" on workers without GPUs,
    #: where the import is a large part of a job; GPU ranks only with "on" (not yet checked on a GPU).
    process_template: Literal["auto", "on", "off"] = "auto"
    #: A registered worker counts for admission while its heartbeat (refreshed every
    #: heartbeat_interval_seconds) is at most this old.
    worker_live_seconds: float = Field(60.0, gt=0)
    #: The capacity a job is planned against while no live worker of its queue is registered: a
    #: typical single-GPU box for 7B-class fine-tuning, one H100 80GB with 192 GiB of RAM and 24 cores.
    #: ``default_worker_gpu`` names a GPU of trainer.plan.gpus' table ("" plans a CPU-only box); None takes
    #: the table's figure (GPU memory; PCIe: 50 GB/s for gen 5) or trainer.plan.gpus' per-core estimate
    #: (CPU AdamW: 2.5 GB/s per core, at most 60).
    default_worker_gpu: str = "h100"
    default_worker_gpu_memory_bytes: int | None = Field(None, ge=0)
    default_worker_host_memory_bytes: int = Field(192 * 1024**3, gt=0)
    default_worker_cores: int = Field(24, ge=1)
    default_worker_cpu_adam_gbps: float | None = Field(None, gt=0, allow_inf_nan=False)
    default_worker_pcie_gbps: float | None = Field(None, gt=0, allow_inf_nan=False)
    #: RLIMIT_MEMLOCK of the default box; None: unlimited.
    default_worker_locked_memory_bytes: int | None = Field(None, ge=0)
    #: The engine's tuning for this worker's machine, for every job it runs (``ZENFLOW_ENGINE_TUNING``, a JSON
    #: object of offload.config.EngineConfig's tuning fields, e.g. ``{"cpu_chunk_elements": 4194304,
    #: "bind_worker_cores": false}``; checked when the worker starts). None of them is a job's to set.
    engine_tuning: dict[str, Any] = {}
    # --- tracking integrations (worker.tracking): the servers a job's ``integrations`` log to ---
    #: The integration types a job may name (``ZENFLOW_ALLOWED_INTEGRATIONS``: comma-separated or a JSON
    #: list; empty: none); another is a 400 at create naming it.
    allowed_integrations: Annotated[list[str], NoDecode] = ["mlflow", "wandb"]
    #: The MLflow tracking server of the workers' jobs ("": none; the runs are left in the job's output,
    #: ``tracking/mlflow-unsent.jsonl``) ...
    mlflow_tracking_uri: str = ""
    #: ... or, for the teams named here (team id -> URI, a JSON object), the team's own server.
    mlflow_team_tracking_uris: dict[str, str] = {}
    #: W&B's server and key (the job process's WANDB_BASE_URL / WANDB_API_KEY); without a key the run is
    #: written in W&B's offline format under the job's output (``tracking/wandb``), for ``wandb sync``.
    wandb_base_url: str = ""
    wandb_api_key: SecretStr | None = None
    #: Events waiting for the tracking thread at most (beyond, the newest are dropped with a warning:
    #: training never waits for a tracking server).
    tracking_queue_items: int = Field(10_000, ge=1)
    #: How often the MLflow sink sends its metrics, and how long one request to the server may take.
    tracking_flush_seconds: float = Field(2.0, gt=0, allow_inf_nan=False)
    tracking_request_timeout_seconds: float = Field(5.0, gt=0, allow_inf_nan=False)
    #: At the job's end, how long the sinks may still try a server that is away before what they hold is
    #: left in the job's output folder.
    tracking_close_seconds: float = Field(20.0, ge=0, allow_inf_nan=False)
    #: text_similarity's ``cosine``: a Hugging Face model folder the API and the workers embed texts with,
    #: on the CPU of the process that grades (trainer.graders.embedding: mean-pooled, normalised; e.g. a
    #: sentence-transformers folder on the models volume). Empty: a grader with cosine is refused.
    grader_embedding_model: str = ""
    # --- the Python grader's sandbox (trainer.graders.sandbox.SandboxLimits, built by worker.grading): ---
    # --- per call, in the API's /v1/fine_tuning/alpha/graders routes and in a worker's training jobs ---
    # The defaults are SandboxLimits' own (tests/store/test_settings.py holds them equal).
    #: CPU seconds of each grader process (RLIMIT_CPU), then ``timeout``.
    python_grader_cpu_seconds: float = Field(10.0, gt=0, le=3600, allow_inf_nan=False)
    #: The whole call, start-up included, then its processes are killed (``timeout``). The API waits for
    #: a /graders/run at most 120 s whatever this says.
    python_grader_wall_seconds: float = Field(30.0, gt=0, le=3600, allow_inf_nan=False)
    #: Address space of each grader process (RLIMIT_AS); the interpreter itself needs some 30 MiB.
    python_grader_memory_bytes: int = Field(512 * 2**20, ge=64 * 2**20, le=2**40)
    #: Processes and threads of one call at once (RLIMIT_NPROC in its own user namespace).
    python_grader_max_processes: int = Field(16, ge=1, le=4096)
    #: The result a call may print back (its JSON number; more fails the call), the largest file it may
    #: write and its private /tmp's size (RLIMIT_FSIZE, the tmpfs), and its open files (RLIMIT_NOFILE:
    #: the interpreter holds some 10 at start).
    python_grader_output_bytes: int = Field(64 * 2**10, ge=1024, le=16 * 2**20)
    python_grader_file_bytes: int = Field(16 * 2**20, ge=2**20, le=2**30)
    python_grader_open_files: int = Field(64, ge=32, le=4096)
    #: Run graders without namespaces where the kernel allows none (no network isolation, the server's
    #: files and user): for a single-tenant install whose graders the operator trusts, never for a
    #: service open to API keys. Off: such a host fails every call with ``sandbox_unavailable``.
    python_grader_allow_unisolated: bool = False

    @field_validator("allowed_integrations", mode="before")
    @classmethod
    def _split_integrations(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip()
            return json.loads(v) if v.startswith("[") else [t.strip() for t in v.split(",") if t.strip()]
        return v

    @field_validator("model_roots", mode="before")
    @classmethod
    def _split_roots(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip()
            return json.loads(v) if v.startswith("[") else [p for p in v.split(os.pathsep) if p]
        return v

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

    def mlflow_uri_for(self, team_id: str) -> str:
        """The MLflow tracking server of ``team_id``'s jobs ("": none configured)."""
        return self.mlflow_team_tracking_uris.get(team_id, self.mlflow_tracking_uri)

    @property
    def embedded(self) -> bool:
        """True when no external broker is configured (the one-command embedded default)."""
        return not self.broker_url


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()

"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-12-02 13:09:13.706320+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "teams",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_teams")),
        sa.UniqueConstraint("name", name=op.f("uq_teams_name")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("team_id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["team_id"], ["teams.id"], name=op.f("fk_api_keys_team_id_teams"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_prefix"), "api_keys", ["prefix"], unique=False)
    op.create_index(op.f("ix_api_keys_team_id"), "api_keys", ["team_id"], unique=False)
    op.create_table(
        "files",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("team_id", sa.String(length=40), nullable=False),
        sa.Column("filename", sa.String(length=512), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("storage_path", sa.Text(), nullable=False),
        sa.Column("num_examples", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["team_id"], ["teams.id"], name=op.f("fk_files_team_id_teams"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_files")),
    )
    op.create_index(op.f("ix_files_team_id"), "files", ["team_id"], unique=False)
    op.create_table(
        "fine_tuning_jobs",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("team_id", sa.String(length=40), nullable=False),
        sa.Column("model", sa.String(length=512), nullable=False),
        sa.Column("training_file_id", sa.String(length=40), nullable=False),
        sa.Column("validation_file_id", sa.String(length=40), nullable=True),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("hyperparameters", sa.JSON(), nullable=False),
        sa.Column("resolved_hyperparameters", sa.JSON(), nullable=True),
        sa.Column("engine", sa.JSON(), nullable=False),
        sa.Column("suffix", sa.String(length=64), nullable=True),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("fine_tuned_model", sa.String(length=512), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("trained_tokens", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("idempotency_key", sa.String(length=255), nullable=True),
        sa.Column("request_hash", sa.String(length=64), nullable=True),
        sa.Column("queue", sa.String(length=64), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("global_step", sa.Integer(), nullable=False),
        sa.Column("total_steps", sa.Integer(), nullable=True),
        sa.Column("output_dir", sa.Text(), nullable=True),
        sa.Column("last_checkpoint_path", sa.Text(), nullable=True),
        sa.Column("worker_hostname", sa.String(length=255), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["team_id"], ["teams.id"], name=op.f("fk_fine_tuning_jobs_team_id_teams"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["training_file_id"],
            ["files.id"],
            name=op.f("fk_fine_tuning_jobs_training_file_id_files"),
            ondelete="RESTRICT",
        ),
        sa.ForeignKeyConstraint(
            ["validation_file_id"],
            ["files.id"],
            name=op.f("fk_fine_tuning_jobs_validation_file_id_files"),
            ondelete="RESTRICT",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fine_tuning_jobs")),
        sa.UniqueConstraint("team_id", "idempotency_key", name="uq_fine_tuning_jobs_team_idempotency"),
    )
    op.create_index(op.f("ix_fine_tuning_jobs_status"), "fine_tuning_jobs", ["status"], unique=False)
    op.create_index(
        "ix_fine_tuning_jobs_team_created", "fine_tuning_jobs", ["team_id", "created_at"], unique=False
    )
    op.create_index(op.f("ix_fine_tuning_jobs_team_id"), "fine_tuning_jobs", ["team_id"], unique=False)
    op.create_table(
        "fine_tuning_job_checkpoints",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("step_number", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("fine_tuned_model_checkpoint", sa.String(length=512), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["fine_tuning_jobs.id"],
            name=op.f("fk_fine_tuning_job_checkpoints_job_id_fine_tuning_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fine_tuning_job_checkpoints")),
        sa.UniqueConstraint("job_id", "step_number", name="uq_fine_tuning_job_checkpoints_step"),
    )
    op.create_index(
        op.f("ix_fine_tuning_job_checkpoints_job_id"), "fine_tuning_job_checkpoints", ["job_id"], unique=False
    )
    op.create_table(
        "fine_tuning_job_events",
        sa.Column("seq", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("level", sa.String(length=16), nullable=False),
        sa.Column("type", sa.String(length=16), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["fine_tuning_jobs.id"],
            name=op.f("fk_fine_tuning_job_events_job_id_fine_tuning_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_fine_tuning_job_events")),
        sa.UniqueConstraint("id", name=op.f("uq_fine_tuning_job_events_id")),
    )
    op.create_index(
        "ix_fine_tuning_job_events_job_seq", "fine_tuning_job_events", ["job_id", "seq"], unique=False
    )
    op.create_table(
        "fine_tuning_job_step_metrics",
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("train_loss", sa.Float(), nullable=True),
        sa.Column("valid_loss", sa.Float(), nullable=True),
        sa.Column("lr", sa.Float(), nullable=True),
        sa.Column("tokens_per_second", sa.Float(), nullable=True),
        sa.Column("step_seconds", sa.Float(), nullable=False),
        sa.Column("stall_seconds", sa.Float(), nullable=False),
        sa.Column("stall_fraction", sa.Float(), nullable=False),
        sa.Column("gpu_utilization", sa.Float(), nullable=True),
        sa.Column("cpu_optimizer_seconds", sa.Float(), nullable=False),
        sa.Column("bytes_device_to_host", sa.BigInteger(), nullable=False),
        sa.Column("bytes_host_to_device", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["fine_tuning_jobs.id"],
            name=op.f("fk_fine_tuning_job_step_metrics_job_id_fine_tuning_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_id", "step", name=op.f("pk_fine_tuning_job_step_metrics")),
    )


def downgrade() -> None:
    op.drop_table("fine_tuning_job_step_metrics")
    op.drop_index("ix_fine_tuning_job_events_job_seq", table_name="fine_tuning_job_events")
    op.drop_table("fine_tuning_job_events")
    op.drop_index(op.f("ix_fine_tuning_job_checkpoints_job_id"), table_name="fine_tuning_job_checkpoints")
    op.drop_table("fine_tuning_job_checkpoints")
    op.drop_index(op.f("ix_fine_tuning_jobs_team_id"), table_name="fine_tuning_jobs")
    op.drop_index("ix_fine_tuning_jobs_team_created", table_name="fine_tuning_jobs")
    op.drop_index(op.f("ix_fine_tuning_jobs_status"), table_name="fine_tuning_jobs")
    op.drop_table("fine_tuning_jobs")
    op.drop_index(op.f("ix_files_team_id"), table_name="files")
    op.drop_table("files")
    op.drop_index(op.f("ix_api_keys_team_id"), table_name="api_keys")
    op.drop_index(op.f("ix_api_keys_prefix"), table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("teams")

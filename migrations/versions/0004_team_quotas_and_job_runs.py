"""team quotas, job runs (GPU accounting, fair share) and the (team_id, status) index

``team_quotas``: a team's own limits (max running jobs, max queued jobs, GPU-hours per rolling
period, storage bytes); a NULL column takes the settings' default. ``fine_tuning_job_runs``: one row
per attempt of a job on a worker (opened by the claim, ended when the job leaves running), which the
GPU-hours quota sums and fair share orders teams by (store.quotas, store.fairshare). Jobs running at
the upgrade get an open run from their heartbeat (or start) so that their time counts from then.
The index serves a team's running and waiting counts.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 10:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JOBS_INDEX = "ix_fine_tuning_jobs_team_status"


def upgrade() -> None:
    op.create_table(
        "team_quotas",
        sa.Column("team_id", sa.String(length=40), nullable=False),
        sa.Column("max_running_jobs", sa.Integer(), nullable=True),
        sa.Column("max_queued_jobs", sa.Integer(), nullable=True),
        sa.Column("gpu_hours", sa.Float(), nullable=True),
        sa.Column("storage_bytes", sa.BigInteger(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["team_id"], ["teams.id"], name=op.f("fk_team_quotas_team_id_teams"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("team_id", name=op.f("pk_team_quotas")),
    )
    op.create_table(
        "fine_tuning_job_runs",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=True),
        sa.Column("team_id", sa.String(length=40), nullable=False),
        sa.Column("queue", sa.String(length=64), nullable=False),
        sa.Column("worker_hostname", sa.String(length=255), nullable=True),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("gpu_seconds", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["fine_tuning_jobs.id"],
            name=op.f("fk_fine_tuning_job_runs_job_id_fine_tuning_jobs"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["team_id"], ["teams.id"], name=op.f("fk_fine_tuning_job_runs_team_id_teams"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fine_tuning_job_runs")),
    )
    op.create_index(op.f("ix_fine_tuning_job_runs_job_id"), "fine_tuning_job_runs", ["job_id"], unique=False)
    op.create_index(
        "ix_fine_tuning_job_runs_team_ended", "fine_tuning_job_runs", ["team_id", "ended_at"], unique=False
    )
    op.create_index(
        "ix_fine_tuning_job_runs_team_queue_started",
        "fine_tuning_job_runs",
        ["team_id", "queue", "started_at"],
        unique=False,
    )
    op.create_index(JOBS_INDEX, "fine_tuning_jobs", ["team_id", "status"], unique=False)
    # Runs in progress at the upgrade: an open run each, so the job's time counts (and ends) as usual.
    op.execute(
        "INSERT INTO fine_tuning_job_runs (id, job_id, team_id, queue, worker_hostname, gpus, started_at) "
        "SELECT 'ftrun-' || id, id, team_id, queue, worker_hostname, 1, "
        "COALESCE(heartbeat_at, started_at, created_at) FROM fine_tuning_jobs WHERE status = 'running'"
    )


def downgrade() -> None:
    op.drop_index(JOBS_INDEX, table_name="fine_tuning_jobs")
    op.drop_index("ix_fine_tuning_job_runs_team_queue_started", table_name="fine_tuning_job_runs")
    op.drop_index("ix_fine_tuning_job_runs_team_ended", table_name="fine_tuning_job_runs")
    op.drop_index(op.f("ix_fine_tuning_job_runs_job_id"), table_name="fine_tuning_job_runs")
    op.drop_table("fine_tuning_job_runs")
    op.drop_table("team_quotas")

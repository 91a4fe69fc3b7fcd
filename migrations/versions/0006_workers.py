"""workers: each worker's measured capacity and heartbeat, for admission at job create

``workers`` has one row per worker process (its Celery node name): the queues it consumes, the
capacity it measured at start (GPU, host memory, cores, locked-memory limit, CPU AdamW and PCIe
bandwidth) and its heartbeat; a job is admitted only when its plan fits a live worker of its queue
(store.worker_registry, api.jobs.admission).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 11:30:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("queues", sa.JSON(), nullable=False),
        sa.Column("capacity", sa.JSON(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_workers")),
    )
    op.create_index(op.f("ix_workers_heartbeat_at"), "workers", ["heartbeat_at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_workers_heartbeat_at"), table_name="workers")
    op.drop_table("workers")

"""fine_tuning_job_nodes: the node slots of a multi-node job's attempt (gang scheduling)

A job with ``resources.nodes`` M > 1 runs on M workers together: each takes a node slot of the job's
next attempt (node 0, the first, records the rendezvous endpoint); the attempt starts when all M are
taken, and a gang that does not form in time, or whose slot heartbeat goes stale, is dissolved
(store.gang).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04 22:30:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "fine_tuning_job_nodes",
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("node_rank", sa.Integer(), nullable=False),
        sa.Column("worker_hostname", sa.String(length=255), nullable=False),
        sa.Column("rdzv_endpoint", sa.String(length=255), nullable=True),
        sa.Column("joined_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("left_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["fine_tuning_jobs.id"],
            name=op.f("fk_fine_tuning_job_nodes_job_id_fine_tuning_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_id", "attempt", "node_rank", name=op.f("pk_fine_tuning_job_nodes")),
    )
    op.create_index(
        op.f("ix_fine_tuning_job_nodes_worker_hostname"),
        "fine_tuning_job_nodes",
        ["worker_hostname"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_fine_tuning_job_nodes_worker_hostname"), table_name="fine_tuning_job_nodes")
    op.drop_table("fine_tuning_job_nodes")

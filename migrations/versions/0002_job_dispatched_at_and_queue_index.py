"""job dispatched_at and the (queue, status, created_at) index

``fine_tuning_jobs.dispatched_at``: when the broker accepted the job's message (worker.dispatch
re-dispatches queued jobs without one, or whose message the broker lost). Jobs already queued at the
upgrade are taken as dispatched at their creation: the reconciler then re-sends them only if the
broker holds fewer messages than there are such jobs. The index serves the queue-position count and
window (``queue = ? AND status IN (...)`` ordered by ``created_at``) and the reconciler's scan.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 18:15:10.005543+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEX = "ix_fine_tuning_jobs_queue_status_created"


def upgrade() -> None:
    op.add_column("fine_tuning_jobs", sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE fine_tuning_jobs SET dispatched_at = created_at WHERE status <> 'validating_files'")
    op.create_index(INDEX, "fine_tuning_jobs", ["queue", "status", "created_at"], unique=False)


def downgrade() -> None:
    op.drop_index(INDEX, table_name="fine_tuning_jobs")
    # A plain ALTER TABLE ... DROP COLUMN, also on SQLite (>= 3.35): a batch "move and copy" would
    # drop and re-create fine_tuning_jobs, and with foreign keys on, that drop cascades to the events.
    op.drop_column("fine_tuning_jobs", "dispatched_at")

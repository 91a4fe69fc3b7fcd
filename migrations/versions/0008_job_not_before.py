"""a queued job's ``not_before``: a job stopped by a full disk waits off the GPU

``fine_tuning_jobs.not_before``: a queued job is neither claimed nor dispatched before this time
(worker.requeue sets it when it re-queues a job whose checkpoint found no space; worker.dispatch sends
its message once it has passed). NULL, every job before this revision: no wait.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-10 09:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("fine_tuning_jobs", sa.Column("not_before", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    # Plain ALTER TABLE ... DROP COLUMN, also on SQLite (>= 3.35), as in 0007.
    op.drop_column("fine_tuning_jobs", "not_before")

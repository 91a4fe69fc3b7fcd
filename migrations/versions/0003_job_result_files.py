"""job result_files

``fine_tuning_jobs.result_files``: ids of the files a succeeded job produced (its per-step metrics
CSV, purpose ``fine-tune-results``, written by ``store.results``). NULL for jobs from before.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 19:05:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("fine_tuning_jobs", sa.Column("result_files", sa.JSON(), nullable=True))


def downgrade() -> None:
    # A plain DROP COLUMN, also on SQLite (see 0002: a batch re-create would cascade to the events).
    op.drop_column("fine_tuning_jobs", "result_files")

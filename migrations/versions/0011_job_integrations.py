"""job integrations: the tracking servers a job logs to

``fine_tuning_jobs.integrations`` keeps the request's ``integrations`` (OpenAI's shape, checked by
worker.tracking.integrations: ``wandb`` and ``mlflow``); NULL for jobs that name none, which is every job
created before this revision.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04 21:30:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("fine_tuning_jobs", sa.Column("integrations", sa.JSON(), nullable=True))


def downgrade() -> None:
    # Plain ALTER TABLE ... DROP COLUMN, as in 0007 (a batch copy of fine_tuning_jobs would cascade).
    op.drop_column("fine_tuning_jobs", "integrations")

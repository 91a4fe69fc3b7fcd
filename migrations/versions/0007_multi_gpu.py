"""multi-GPU jobs: a job's ``resources`` and a worker's ``gpus_per_job``

``fine_tuning_jobs.resources`` holds what a job asked of its worker (trainer.spec.ResourceSpec: ``gpus``,
the data-parallel ranks); NULL, every job before this revision, means the defaults (one GPU).
``workers.gpus_per_job`` is the size of the jobs a worker runs (``--gpus-per-job``); admission refuses a
job larger than every live worker serves. Existing workers read 1 (the server default).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04 09:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("fine_tuning_jobs", sa.Column("resources", sa.JSON(), nullable=True))
    op.add_column(
        "workers", sa.Column("gpus_per_job", sa.Integer(), server_default=sa.text("1"), nullable=False)
    )


def downgrade() -> None:
    # Plain ALTER TABLE ... DROP COLUMN, also on SQLite (>= 3.35), as in 0002: a batch "move and copy"
    # of fine_tuning_jobs would drop and re-create it, and with foreign keys on, cascade to its events.
    op.drop_column("workers", "gpus_per_job")
    op.drop_column("fine_tuning_jobs", "resources")

"""step method metrics: a method's own figures on each step's metrics row

``fine_tuning_job_step_metrics.method_metrics``: a reinforcement job's rewards of the step (mean, min,
max, sub-rewards by grader, completion tokens, grader errors, sampling and grading seconds; worker.job.
reporter), served by the job's metrics endpoint and written to its results CSV. NULL for supervised and
DPO steps, and for every step before this revision.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07 21:45:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | Sequence[str] | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("fine_tuning_job_step_metrics", sa.Column("method_metrics", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("fine_tuning_job_step_metrics", "method_metrics")

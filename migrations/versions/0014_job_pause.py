"""job pause: a pending pause request of a running job

``fine_tuning_jobs.pause_requested``: a user asked a running job to pause (``POST
/v1/fine_tuning/jobs/{id}/pause``); its runner stops at the next step, checkpoints there and writes the
new status ``paused`` (a string like every status: no type to change), which clears it. Every job before
this revision reads false (the server default).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06 15:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "fine_tuning_jobs",
        sa.Column("pause_requested", sa.Boolean(), server_default=sa.false(), nullable=False),
    )


def downgrade() -> None:
    # Plain ALTER TABLE ... DROP COLUMN, as in 0007 (a batch copy of fine_tuning_jobs would cascade).
    # A paused job has no status before this revision: it goes back to its queue, to resume from its
    # checkpoint as a re-queued job does.
    op.execute("UPDATE fine_tuning_jobs SET status = 'queued', dispatched_at = NULL WHERE status = 'paused'")
    op.drop_column("fine_tuning_jobs", "pause_requested")

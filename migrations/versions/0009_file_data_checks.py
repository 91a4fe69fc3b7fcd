"""a file's ``data_checks``: outcomes of checking it with a model's tokenizer, reused by later creates

``files.data_checks`` maps a check key (api.jobs.data_check.check_key: the model's identity, the data
options, the bounds of one example, the file's digest and size) to that check's outcome (passed, with
its counts; or the lines' errors). An upload with ``model`` and each job's create keep theirs, so a
create with the same model and options does not tokenize the file again. NULL, every file before this
revision: none kept (the next create checks it).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-10 12:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("files", sa.Column("data_checks", sa.JSON(), nullable=True))


def downgrade() -> None:
    # Plain ALTER TABLE ... DROP COLUMN, also on SQLite (>= 3.35), as in 0007.
    op.drop_column("files", "data_checks")

"""download checksums computed again: the download tar changed

The model download became a deterministic tar of the model's files only (api.model_download: an
allow-list, so a multi-rank checkpoint no longer carries its ``engine-rank*.pt`` training state; one
mtime, mode and owner for every member). Checksums cached by earlier downloads
(``models.content_sha256`` / ``adapter_sha256``) describe the old tar, so they are cleared and the
next download of each model computes its own. The downgrade keeps them cleared (no old value to put
back; a NULL checksum is always computed again).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04 16:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("UPDATE models SET content_sha256 = NULL, adapter_sha256 = NULL")


def downgrade() -> None:
    pass

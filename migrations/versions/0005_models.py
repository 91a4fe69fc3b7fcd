"""models: a team's fine-tuned models and checkpoints by their ``ft:`` ids

``models`` maps an OpenAI-shaped id (``ft:<base>:<team>:<suffix>:<job id>``, a checkpoint's with
``:ckpt-step-<n>``) to the files it names, owned by a team (store.model_ids). The upgrade backfills
a row for every succeeded job's final model and every checkpoint row, and points the jobs'
``fine_tuned_model`` and the checkpoints' ``fine_tuned_model_checkpoint`` (server paths until now) at the
new ids; the downgrade puts the paths back.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 11:00:00+00:00
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The id rules as of this revision (store.model_ids), frozen here so the backfill never changes.
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _part(text: str | None) -> str:
    return _UNSAFE.sub("-", text or "").strip("-.")[:64]


def _base_name(model: str) -> str:
    return _part(Path(model.rstrip("/")).name or model) or "model"


def _adapter(path: str) -> str | None:
    adapter = Path(path) / "adapter"
    return str(adapter) if adapter.is_dir() else None


def upgrade() -> None:
    op.create_table(
        "models",
        sa.Column("id", sa.String(length=512), nullable=False),
        sa.Column("team_id", sa.String(length=40), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("step_number", sa.Integer(), nullable=True),
        sa.Column("base_model", sa.String(length=512), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("adapter_path", sa.Text(), nullable=True),
        sa.Column("content_sha256", sa.String(length=64), nullable=True),
        sa.Column("adapter_sha256", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["fine_tuning_jobs.id"],
            name=op.f("fk_models_job_id_fine_tuning_jobs"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["team_id"], ["teams.id"], name=op.f("fk_models_team_id_teams"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_models")),
    )
    op.create_index(op.f("ix_models_job_id"), "models", ["job_id"], unique=False)
    op.create_index("ix_models_team_created", "models", ["team_id", "created_at"], unique=False)
    _backfill()


def _backfill() -> None:
    """A models row for each succeeded job's final model and each checkpoint; the jobs point at the ids."""
    conn = op.get_bind()
    jobs = sa.table(
        "fine_tuning_jobs",
        sa.column("id"),
        sa.column("team_id"),
        sa.column("model"),
        sa.column("suffix"),
        sa.column("status"),
        sa.column("fine_tuned_model"),
        sa.column("finished_at"),
        sa.column("created_at"),
    )
    teams = sa.table("teams", sa.column("id"), sa.column("name"))
    ckpts = sa.table(
        "fine_tuning_job_checkpoints",
        sa.column("id"),
        sa.column("job_id"),
        sa.column("step_number"),
        sa.column("path"),
        sa.column("fine_tuned_model_checkpoint"),
        sa.column("created_at"),
    )
    models = sa.table(
        "models",
        *(
            sa.column(c)
            for c in (
                "id",
                "team_id",
                "kind",
                "job_id",
                "step_number",
                "base_model",
                "path",
                "adapter_path",
                "created_at",
            )
        ),
    )
    rows = conn.execute(
        sa.select(
            jobs.c.id,
            jobs.c.team_id,
            jobs.c.model,
            jobs.c.suffix,
            jobs.c.status,
            jobs.c.fine_tuned_model,
            jobs.c.finished_at,
            jobs.c.created_at,
            teams.c.name,
        ).join(teams, teams.c.id == jobs.c.team_id)
    ).all()
    ids: dict[str, str] = {}
    for job in rows:
        base = _base_name(job.model)
        ids[job.id] = f"ft:{base}:{_part(job.name) or 'team'}:{_part(job.suffix)}:{job.id}"
        if job.status == "succeeded" and job.fine_tuned_model and not job.fine_tuned_model.startswith("ft:"):
            conn.execute(
                sa.insert(models).values(
                    id=ids[job.id],
                    team_id=job.team_id,
                    kind="fine-tuned",
                    job_id=job.id,
                    step_number=None,
                    base_model=base,
                    path=job.fine_tuned_model,
                    adapter_path=_adapter(job.fine_tuned_model),
                    created_at=job.finished_at or job.created_at or datetime.now(UTC),
                )
            )
            conn.execute(sa.update(jobs).where(jobs.c.id == job.id).values(fine_tuned_model=ids[job.id]))
    bases = {job.id: _base_name(job.model) for job in rows}
    teams_of = {job.id: job.team_id for job in rows}
    for ck in conn.execute(
        sa.select(ckpts.c.id, ckpts.c.job_id, ckpts.c.step_number, ckpts.c.path, ckpts.c.created_at)
    ).all():
        ck_id = f"{ids[ck.job_id]}:ckpt-step-{ck.step_number}"
        conn.execute(
            sa.insert(models).values(
                id=ck_id,
                team_id=teams_of[ck.job_id],
                kind="checkpoint",
                job_id=ck.job_id,
                step_number=ck.step_number,
                base_model=bases[ck.job_id],
                path=ck.path,
                adapter_path=_adapter(ck.path),
                created_at=ck.created_at,
            )
        )
        conn.execute(sa.update(ckpts).where(ckpts.c.id == ck.id).values(fine_tuned_model_checkpoint=ck_id))


def downgrade() -> None:
    # The jobs and checkpoints point at their files' paths again, as before this revision.
    op.execute(
        "UPDATE fine_tuning_jobs SET fine_tuned_model = (SELECT m.path FROM models m WHERE "
        "m.id = fine_tuning_jobs.fine_tuned_model) WHERE fine_tuned_model LIKE 'ft:%'"
    )
    op.execute("UPDATE fine_tuning_job_checkpoints SET fine_tuned_model_checkpoint = path")
    op.drop_index("ix_models_team_created", table_name="models")
    op.drop_index(op.f("ix_models_job_id"), table_name="models")
    op.drop_table("models")

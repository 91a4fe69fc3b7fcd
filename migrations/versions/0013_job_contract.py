"""job contract: a job's request and its resolutions replace its four settings columns

``fine_tuning_jobs.request`` keeps what the client asked (contract.job.JobRequest: method,
hyperparameters, engine, resources, the fields it gave only) and ``fine_tuning_jobs.resolutions`` what
the job is (contract.job.Resolution records, the last one current). They replace ``hyperparameters``,
``resolved_hyperparameters``, ``engine`` and ``resources``.

Existing rows: the request is made of the four old columns (a DPO job's ``hyperparameters.dpo`` becomes
its ``method``; engine fields that are no longer a job's, the worker's tuning, are left out). A row whose
run recorded its settings (``resolved_hyperparameters``, and the engine mode either given or in its
"Training started" event) gets one resolution of what it ran with, its sources unknown; any other row
(a job still waiting) none: its run resolves it. The downgrade writes the four columns back from the
request and the current resolution.

The transformation is written out here, not imported, so that this revision means the same whatever the
code becomes.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06 13:30:00+00:00
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: The engine fields a job may still give (the rest are a worker's tuning now).
_PUBLIC_ENGINE = {
    "mode", "accumulate_on", "shard_params", "betas", "eps", "weight_decay", "max_grad_norm", "topk_ratio",
    "update_interval", "select_interval", "full_warm_up_rounds", "max_update_interval", "overlap_step",
    "scale_cpu_lr",
}  # fmt: skip
#: The engine's knob defaults at this revision, for a recorded resolution.
_KNOB_DEFAULTS: dict[str, Any] = {
    "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "max_grad_norm": 1.0, "topk_ratio": 0.1,
    "update_interval": 4, "select_interval": "epoch", "full_warm_up_rounds": 0, "max_update_interval": 16,
    "overlap_step": True, "scale_cpu_lr": False,
}  # fmt: skip
_POLICIES = {"update_interval": "adaptive", "select_interval": "epoch"}
#: Keys of the old resolved hyperparameters that are not hyperparameters.
_NOT_HYPERPARAMETERS = ("engine.shard_params", "dpo")


def _loads(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _engine(given: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in given.items() if k in _PUBLIC_ENGINE}
    for key, policy in _POLICIES.items():
        if out.get(key) == "auto":
            out[key] = policy
    return out


def _request(row: Any) -> dict[str, Any]:
    hp = dict(_loads(row.hyperparameters) or {})
    dpo = hp.pop("dpo", None)
    request: dict[str, Any] = {
        "model": row.model,
        "training_file": row.training_file_id,
        "validation_file": row.validation_file_id,
        "hyperparameters": hp,
        "engine": _engine(dict(_loads(row.engine) or {})),
    }
    if isinstance(dpo, dict):
        request["method"] = {"type": "dpo", **({"beta": dpo["beta"]} if "beta" in dpo else {})}
    resources = _loads(row.resources)
    if resources:
        request["resources"] = resources
    return request


def _ran_with(conn: Any, job_id: str) -> dict[str, Any] | None:
    """The newest "Training started" event's data (the run's engine mode, dtype, sharding)."""
    rows = conn.execute(
        sa.text("SELECT data FROM fine_tuning_job_events WHERE job_id = :id ORDER BY seq DESC"),
        {"id": job_id},
    )
    for (data,) in rows:
        data = _loads(data)
        if isinstance(data, dict) and data.get("type") == "run_started":
            return data
    return None


def _resolution(conn: Any, row: Any, request: dict[str, Any]) -> dict[str, Any] | None:
    resolved = _loads(row.resolved_hyperparameters)
    if not isinstance(resolved, dict):
        return None
    ran = _ran_with(conn, row.id) or {}
    engine = request["engine"]
    mode = ran.get("mode") or engine.get("mode")
    if mode not in ("device", "offload", "zenflow"):
        return None
    shard = resolved.get("engine.shard_params", ran.get("sharded", False))
    acc = engine.get("accumulate_on")
    dpo = request.get("method")
    return {
        "at": "run" if ran else "create",
        "reason": "recorded by migration 0013 from the settings the job stored; their sources are unknown",
        "decided_at": datetime.now(UTC).isoformat(),
        "machine": None,
        "num_examples": int(resolved.get("num_examples") or 1),
        "num_tokens": None,
        "plan": None,
        "job": {
            "method": {
                "type": "dpo",
                "beta": (_loads(row.hyperparameters) or {}).get("dpo", {}).get("beta", 0.1),
            }
            if dpo
            else {"type": "supervised"},
            "hyperparameters": {k: v for k, v in resolved.items() if k not in _NOT_HYPERPARAMETERS},
            "engine": {
                **_KNOB_DEFAULTS,
                **{k: v for k, v in engine.items() if k in _KNOB_DEFAULTS},
                "mode": mode,
                "accumulate_on": acc if acc in ("host", "device") else "host",
                "shard_params": bool(shard),
                "landing_buffers": True,
            },
            "resources": {"gpus": 1, "nodes": 1, **(request.get("resources") or {})},
            "dtype": ran.get("dtype") if ran.get("dtype") in ("float32", "bfloat16") else "float32",
            "sources": {},
        },
    }


def upgrade() -> None:
    op.add_column("fine_tuning_jobs", sa.Column("request", sa.JSON(), nullable=True))
    op.add_column("fine_tuning_jobs", sa.Column("resolutions", sa.JSON(), nullable=True))
    conn = op.get_bind()
    jobs = sa.table(
        "fine_tuning_jobs",
        sa.column("id", sa.String),
        sa.column("request", sa.JSON),
        sa.column("resolutions", sa.JSON),
    )
    rows = conn.execute(
        sa.text(
            "SELECT id, model, training_file_id, validation_file_id, hyperparameters, resolved_hyperparameters, "
            "engine, resources FROM fine_tuning_jobs"
        )
    ).all()
    for row in rows:
        request = _request(row)
        resolution = _resolution(conn, row, request)
        conn.execute(
            jobs.update()
            .where(jobs.c.id == row.id)
            .values(request=request, resolutions=[resolution] if resolution else [])
        )
    # Plain ALTER TABLE ... DROP COLUMN (a batch copy of fine_tuning_jobs would cascade), as in 0007. The
    # new columns stay nullable (SQLite cannot make a column NOT NULL in place): every create writes both.
    for column in ("hyperparameters", "resolved_hyperparameters", "engine", "resources"):
        op.drop_column("fine_tuning_jobs", column)


def downgrade() -> None:
    op.add_column("fine_tuning_jobs", sa.Column("hyperparameters", sa.JSON(), nullable=True))
    op.add_column("fine_tuning_jobs", sa.Column("resolved_hyperparameters", sa.JSON(), nullable=True))
    op.add_column("fine_tuning_jobs", sa.Column("engine", sa.JSON(), nullable=True))
    op.add_column("fine_tuning_jobs", sa.Column("resources", sa.JSON(), nullable=True))
    conn = op.get_bind()
    jobs = sa.table(
        "fine_tuning_jobs",
        sa.column("id", sa.String),
        sa.column("hyperparameters", sa.JSON),
        sa.column("resolved_hyperparameters", sa.JSON),
        sa.column("engine", sa.JSON),
        sa.column("resources", sa.JSON),
    )
    for row in conn.execute(sa.text("SELECT id, request, resolutions FROM fine_tuning_jobs")).all():
        request, resolutions = _loads(row.request) or {}, _loads(row.resolutions) or []
        hp = dict(request.get("hyperparameters") or {})
        method = request.get("method") or {}
        if method.get("type") == "dpo":
            hp["dpo"] = {"beta": method.get("beta", "auto")}
        current = resolutions[-1]["job"] if resolutions else None
        resolved = (
            {**current["hyperparameters"], "engine.shard_params": current["engine"]["shard_params"]}
            if current
            else None
        )
        conn.execute(
            jobs.update()
            .where(jobs.c.id == row.id)
            .values(
                hyperparameters=hp,
                resolved_hyperparameters=resolved,
                engine=request.get("engine") or {},
                resources=request.get("resources"),
            )
        )
    op.drop_column("fine_tuning_jobs", "resolutions")
    op.drop_column("fine_tuning_jobs", "request")
    if conn.dialect.name != "sqlite":  # as they were (SQLite's stay nullable: see the upgrade)
        op.alter_column("fine_tuning_jobs", "hyperparameters", nullable=False)
        op.alter_column("fine_tuning_jobs", "engine", nullable=False)

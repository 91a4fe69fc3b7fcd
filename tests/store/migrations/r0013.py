"""Migration 0013 (the job contract): a job's four settings columns become its request and resolutions,
validated by the contract; a job that ran keeps what it ran with, a waiting one is left to its run; the
downgrade writes the columns back. PostgreSQL and SQLite."""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import text

from api import migrate
from contract.job import RESOLUTIONS, JobRequest
from store.db import make_engine
from tests.store.migrations.r0005 import ROWS

RESOLVED = {
    "n_epochs": 2, "batch_size": 4, "learning_rate": 3e-3, "base_learning_rate": 3e-3,
    "learning_rate_multiplier": 1.0, "warmup_steps": 1, "lr_scheduler": "cosine", "min_lr_ratio": 0.1,
    "max_seq_length": 64, "eval_every": None, "checkpoint_every": 4, "seed": 3, "num_examples": 40,
    "steps_per_epoch": 10, "total_steps": 20, "micro_batch_size": 4, "dpo": {"beta": 0.2},
    "engine.shard_params": True,
}  # fmt: skip
JOB = (
    "INSERT INTO fine_tuning_jobs (id, team_id, model, training_file_id, status, hyperparameters, engine, "
    "resources, resolved_hyperparameters, seed, created_at, queue, cancel_requested, attempts, global_step) "
    "VALUES (:id, 'team-1', 'tiny-llama', 'file-1', :status, :hp, :engine, :resources, :resolved, 3, "
    "'2026-01-01 00:00:00+00', 'q', false, 1, 0)"
)
EVENT = (
    "INSERT INTO fine_tuning_job_events (id, job_id, created_at, level, type, message, data) VALUES "
    "('ftevent-1', 'ftjob-ran', '2026-01-01 00:00:01+00', 'info', 'message', 'Training started', :data)"
)


def _seed(url: str) -> None:
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            for sql in ROWS:
                conn.execute(text(sql))
            hp = {"n_epochs": 2, "batch_size": 4, "dpo": {"beta": 0.2}}
            engine_given = {"mode": "auto", "cpu_threads": 2, "update_interval": "auto", "topk_ratio": 0.2}
            conn.execute(
                text(JOB),
                {
                    "id": "ftjob-ran",
                    "status": "succeeded",
                    "hp": json.dumps(hp),
                    "engine": json.dumps(engine_given),
                    "resources": json.dumps({"gpus": 2}),
                    "resolved": json.dumps(RESOLVED),
                },
            )
            started = {"type": "run_started", "mode": "zenflow", "dtype": "bfloat16", "sharded": True}
            conn.execute(text(EVENT), {"data": json.dumps(started)})
            conn.execute(
                text(JOB),
                {
                    "id": "ftjob-waits",
                    "status": "queued",
                    "hp": json.dumps({"n_epochs": 1}),
                    "engine": "{}",
                    "resources": None,
                    "resolved": None,
                },
            )
    finally:
        engine.dispose()


def _read(url: str, sql: str) -> dict[str, tuple[object, ...]]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return {
                r[0]: tuple(json.loads(v) if isinstance(v, str) else v for v in r[1:])
                for r in conn.execute(text(sql))
            }
    finally:
        engine.dispose()


def check(url: str, tmp: Path) -> None:
    migrate.upgrade(url, "0012")
    _seed(url)
    migrate.upgrade(url)
    migrate.check(url)  # no drift against store/orm.py
    rows = _read(url, "SELECT id, request, resolutions FROM fine_tuning_jobs")
    ran, waits = (
        JobRequest.model_validate(rows["ftjob-ran"][0]),
        JobRequest.model_validate(rows["ftjob-waits"][0]),
    )
    assert ran.method.type == "dpo" and ran.method.beta == 0.2 and ran.training_file == "file-1"
    assert ran.hyperparameters.model_fields_set == {"n_epochs", "batch_size"} and ran.resources.gpus == 2
    # the worker's tuning (cpu_threads) is no job's setting any more; "auto" windows keep their meaning
    assert ran.engine.model_dump(exclude_unset=True) == {
        "mode": "auto",
        "update_interval": "adaptive",
        "topk_ratio": 0.2,
    }
    (resolution,) = RESOLUTIONS.validate_python(rows["ftjob-ran"][1])
    job = resolution.job
    assert resolution.at == "run" and job.engine.mode == "zenflow" and job.engine.shard_params is True
    assert job.engine.topk_ratio == 0.2 and job.dtype == "bfloat16" and job.method.type == "dpo"
    assert job.hyperparameters.total_steps == 20 and job.resources.gpus == 2
    assert waits.hyperparameters.n_epochs == 1 and RESOLUTIONS.validate_python(rows["ftjob-waits"][1]) == []
    migrate.downgrade(url, "0012")
    old = _read(
        url, "SELECT id, hyperparameters, engine, resources, resolved_hyperparameters FROM fine_tuning_jobs"
    )
    hp, engine, resources, resolved = old["ftjob-ran"]
    assert hp == {"n_epochs": 2, "batch_size": 4, "dpo": {"beta": 0.2}} and resources == {"gpus": 2}
    assert engine == {"mode": "auto", "update_interval": "adaptive", "topk_ratio": 0.2}
    assert (
        isinstance(resolved, dict)
        and resolved["engine.shard_params"] is True
        and resolved["total_steps"] == 20
    )
    assert old["ftjob-waits"][3] is None

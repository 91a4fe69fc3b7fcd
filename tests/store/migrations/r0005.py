"""Migration 0005 (models) on a database with finished jobs: a succeeded job's final model and every
checkpoint get a models row under their ``ft:`` id (the LoRA adapter found on disk), the job and
checkpoint rows point at the ids, and the downgrade puts the paths back; PostgreSQL and SQLite."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text

from api import migrate
from store.db import make_engine

ROWS = [
    "INSERT INTO teams (id, name, created_at) VALUES ('team-1', 'ML team', '2026-01-01 00:00:00+00')",
    "INSERT INTO files (id, team_id, filename, purpose, bytes, sha256, storage_path, num_examples, status, created_at) "
    "VALUES ('file-1', 'team-1', 'f', 'fine-tune', 1, '0', '/x', 1, 'processed', '2026-01-01 00:00:00+00')",
]
JOB = (
    "INSERT INTO fine_tuning_jobs (id, team_id, model, training_file_id, status, hyperparameters, engine, seed, "
    "created_at, queue, cancel_requested, attempts, global_step, suffix, fine_tuned_model) VALUES "
    "('{id}', 'team-1', '{model}', 'file-1', '{status}', '{{}}', '{{}}', 0, '2026-01-01 00:00:00+00', 'q', "
    "false, 1, 0, {suffix}, {ftm})"
)
CKPT = (
    "INSERT INTO fine_tuning_job_checkpoints (id, job_id, step_number, path, fine_tuned_model_checkpoint, "
    "metrics, created_at) VALUES ('ftckpt-{step}', '{job}', {step}, '{path}', '{path}', '{{}}', "
    "'2026-01-01 00:00:00+00')"
)


def check(url: str, tmp: Path) -> None:
    outputs = tmp / "out"
    final, ckpt = outputs / "final", outputs / "checkpoint-000004"
    (final / "adapter").mkdir(parents=True)
    ckpt.mkdir()
    migrate.upgrade(url, "0004")
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            for sql in ROWS:
                conn.execute(text(sql))
            conn.execute(
                text(
                    JOB.format(
                        id="ftjob-done",
                        model="/models/Qwen2.5-0.5B/",
                        status="succeeded",
                        suffix="'my:suffix'",
                        ftm=f"'{final}'",
                    )
                )
            )
            conn.execute(
                text(
                    JOB.format(
                        id="ftjob-run", model="tiny-llama", status="running", suffix="NULL", ftm="NULL"
                    )
                )
            )
            conn.execute(text(CKPT.format(step=4, job="ftjob-done", path=ckpt)))
            conn.execute(text(CKPT.format(step=2, job="ftjob-run", path=outputs / "other")))
        migrate.upgrade(url)
        migrate.check(url)
        done = "ft:Qwen2.5-0.5B:ML-team:my-suffix:ftjob-done"
        with engine.connect() as conn:
            models = {
                r.id: tuple(r)[1:]
                for r in conn.execute(
                    text(
                        "SELECT id, team_id, kind, job_id, step_number, base_model, path, adapter_path, deleted_at "
                        "FROM models"
                    )
                )
            }
            jobs: dict[str, str | None] = dict(
                conn.execute(text("SELECT id, fine_tuned_model FROM fine_tuning_jobs")).all()
            )
            ckpts: dict[int, str] = dict(
                conn.execute(
                    text("SELECT step_number, fine_tuned_model_checkpoint FROM fine_tuning_job_checkpoints")
                ).all()
            )
        assert models == {
            done: (
                "team-1",
                "fine-tuned",
                "ftjob-done",
                None,
                "Qwen2.5-0.5B",
                str(final),
                str(final / "adapter"),
                None,
            ),
            f"{done}:ckpt-step-4": (
                "team-1",
                "checkpoint",
                "ftjob-done",
                4,
                "Qwen2.5-0.5B",
                str(ckpt),
                None,
                None,
            ),
            "ft:tiny-llama:ML-team::ftjob-run:ckpt-step-2": (
                "team-1",
                "checkpoint",
                "ftjob-run",
                2,
                "tiny-llama",
                str(outputs / "other"),
                None,
                None,
            ),
        }
        assert jobs == {"ftjob-done": done, "ftjob-run": None}
        assert ckpts == {4: f"{done}:ckpt-step-4", 2: "ft:tiny-llama:ML-team::ftjob-run:ckpt-step-2"}

        migrate.downgrade(url, "0004")
        with engine.connect() as conn:
            assert dict(conn.execute(text("SELECT id, fine_tuned_model FROM fine_tuning_jobs")).all()) == {
                "ftjob-done": str(final),
                "ftjob-run": None,
            }
            assert dict(
                conn.execute(
                    text("SELECT step_number, fine_tuned_model_checkpoint FROM fine_tuning_job_checkpoints")
                ).all()
            ) == {4: str(ckpt), 2: str(outputs / "other")}
    finally:
        engine.dispose()

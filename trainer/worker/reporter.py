"""Training events -> database rows: the job process's ``on_event`` callback.

Each :mod:`trainer.events` class has its handler: messages become ``fine_tuning_job_events`` rows
(a ``metrics`` event per step), each step a ``fine_tuning_job_step_metrics`` row, each checkpoint a
``fine_tuning_job_checkpoints`` row (removed again when the checkpoint is pruned); the job row gets
total_steps, resolved_hyperparameters, global_step and last_checkpoint_path. One short transaction
per event.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from store.db import session_scope
from store.jobs import add_event
from store.models import FineTuningJob, JobCheckpoint, JobStepMetric, utcnow
from trainer.events import (
    CheckpointRemoved,
    CheckpointSaved,
    ErrorEvent,
    EvalEvent,
    Event,
    LogEvent,
    RunStarted,
    StepEvent,
)


class DBReporter:
    """The on_event callback of a job run from the database."""

    def __init__(self, job_id: str, url: str, hostname: str) -> None:
        self.job_id, self.url, self.hostname = job_id, url, hostname
        self.total_steps: int | None = None
        self.on_cuda = False
        self._handlers: dict[type[Event], Callable[[Session, Any], None]] = {
            LogEvent: self._on_log,
            RunStarted: self._on_run_started,
            StepEvent: self._on_step,
            EvalEvent: self._on_eval,
            CheckpointSaved: self._on_checkpoint,
            CheckpointRemoved: self._on_checkpoint_removed,
            ErrorEvent: self._on_error,
        }

    def __call__(self, ev: Event) -> None:
        handler = self._handlers.get(type(ev))
        if handler is not None:
            with session_scope(self.url) as s:
                handler(s, ev)

    def _job_update(self, s: Session, **values: Any) -> None:
        s.execute(update(FineTuningJob).where(FineTuningJob.id == self.job_id).values(**values))

    def _checkpoint_row(self, s: Session, step: int) -> JobCheckpoint | None:
        return s.execute(
            select(JobCheckpoint).where(JobCheckpoint.job_id == self.job_id, JobCheckpoint.step_number == step)
        ).scalar_one_or_none()

    def _on_log(self, s: Session, ev: LogEvent) -> None:
        add_event(s, self.job_id, ev.message, level=ev.level, data=ev.data or None)

    def _on_run_started(self, s: Session, ev: RunStarted) -> None:
        self.total_steps = ev.total_steps
        self.on_cuda = ev.device.startswith("cuda")
        self._job_update(s, total_steps=ev.total_steps, resolved_hyperparameters=ev.hyperparameters)
        what = f"Training resumed at step {ev.start_step}" if ev.start_step else "Training started"
        add_event(
            s,
            self.job_id,
            f"{what}: {ev.total_steps} steps, {ev.num_examples} examples, {ev.trainable_parameters:,} trainable "
            f"parameters on {ev.device} ({ev.dtype}, engine mode {ev.mode})",
            data=ev.as_dict(),
        )

    def _on_step(self, s: Session, ev: StepEvent) -> None:
        eng = ev.engine
        s.merge(
            JobStepMetric(
                job_id=self.job_id,
                step=ev.step,
                created_at=utcnow(),
                train_loss=ev.loss,
                lr=ev.lr,
                tokens_per_second=ev.tokens_per_second,
                step_seconds=ev.step_seconds,
                stall_seconds=ev.stall_seconds,
                stall_fraction=ev.stall_fraction,
                gpu_utilization=(1.0 - ev.stall_fraction) if self.on_cuda else None,
                cpu_optimizer_seconds=float(eng.cpu_optimizer_seconds),
                bytes_device_to_host=int(eng.bytes_device_to_host),
                bytes_host_to_device=int(eng.bytes_host_to_device),
            )
        )
        self._job_update(s, global_step=ev.step, heartbeat_at=utcnow())
        add_event(
            s,
            self.job_id,
            f"Step {ev.step}/{ev.total_steps}: training loss={ev.loss:.4f}",
            type="metrics",
            data={
                "step": ev.step,
                "total_steps": ev.total_steps,
                "train_loss": ev.loss,
                "lr": ev.lr,
                "tokens_per_second": ev.tokens_per_second,
                "stall_fraction": ev.stall_fraction,
            },
        )

    def _on_eval(self, s: Session, ev: EvalEvent) -> None:
        row = s.get(JobStepMetric, (self.job_id, ev.step))
        if row is not None:
            row.valid_loss = ev.valid_loss
        add_event(
            s,
            self.job_id,
            f"Step {ev.step}: validation loss={ev.valid_loss:.4f}",
            type="metrics",
            data={"step": ev.step, "valid_loss": ev.valid_loss, "valid_tokens": ev.valid_tokens},
        )

    def _on_checkpoint(self, s: Session, ev: CheckpointSaved) -> None:
        row = self._checkpoint_row(s, ev.step)
        metrics = {k: v for k, v in ev.metrics.items() if v is not None}
        if row is None:
            s.add(
                JobCheckpoint(
                    job_id=self.job_id,
                    step_number=ev.step,
                    path=ev.path,
                    fine_tuned_model_checkpoint=ev.path,
                    metrics=metrics,
                )
            )
        else:
            row.path = row.fine_tuned_model_checkpoint = ev.path
            row.metrics = metrics
        self._job_update(s, last_checkpoint_path=ev.path, heartbeat_at=utcnow())
        add_event(s, self.job_id, f"Checkpoint saved at step {ev.step}", data={"step": ev.step, "path": ev.path})

    def _on_checkpoint_removed(self, s: Session, ev: CheckpointRemoved) -> None:
        row = self._checkpoint_row(s, ev.step)
        if row is not None:
            s.delete(row)

    def _on_error(self, s: Session, ev: ErrorEvent) -> None:
        add_event(s, self.job_id, ev.message, level="error", data={"error_type": ev.error_type, "errors": ev.errors[:20]})

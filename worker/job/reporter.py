"""Training events -> database rows: the job process's ``on_event`` callback.

Each :mod:`trainer.events` class has its handler, which describes the rows the event makes as a
:class:`~worker.job.writer.Write`: messages become ``fine_tuning_job_events`` rows (a ``metrics``
event per step), each step a ``fine_tuning_job_step_metrics`` row, each checkpoint a
``fine_tuning_job_checkpoints`` row (removed again when the checkpoint is pruned); the job row gets
total_steps, global_step and last_checkpoint_path, and a resolution the run made is appended to its
resolutions. The
:class:`~worker.job.writer.ReportWriter` writes them in order in the background, waiting out
database outages; a step replayed after a resume updates its metrics row and gets no second event.
An ErrorEvent makes a row only for a full disk (a warning: the job is re-queued); a failure's one error
event is the failed end state's (worker.job.runner), which carries the error's details.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from store.orm import utcnow
from trainer.events import (
    CheckpointRemoved,
    CheckpointSaved,
    ErrorEvent,
    EvalEvent,
    Event,
    LogEvent,
    Resolved,
    RunStarted,
    StepEvent,
)
from trainer.run.checkpoint import list_checkpoints
from worker.errors import scrub
from worker.job.writer import ReportWriter, Write, event_row


class DBReporter:
    """The on_event callback of a job run from the database: events -> writes for ``writer``."""

    def __init__(self, writer: ReportWriter) -> None:
        self.writer = writer
        self.total_steps: int | None = None
        self.on_cuda = False
        self._handlers: dict[type[Event], Callable[[Any], Write | None]] = {
            LogEvent: self._on_log,
            RunStarted: self._on_run_started,
            StepEvent: self._on_step,
            EvalEvent: self._on_eval,
            CheckpointSaved: self._on_checkpoint,
            CheckpointRemoved: self._on_checkpoint_removed,
            ErrorEvent: self._on_error,
            Resolved: self._on_resolved,
        }

    def __call__(self, ev: Event) -> None:
        handler = self._handlers.get(type(ev))
        write = handler(ev) if handler is not None else None
        if write is not None:
            self.writer.put(write)

    def sync_checkpoints(self, output_dir: Path) -> None:
        """Make the job's checkpoint rows match the complete checkpoints in ``output_dir`` (at the start
        of a run: one written while the database was away, or by a run that died before its row was
        written, is registered; rows of checkpoints no longer on disk go)."""
        found = [
            {"step": c.step, "path": str(c.path), "metrics": c.manifest.get("metrics") or {}}
            for c in list_checkpoints(output_dir)
        ]
        self.writer.put(
            Write(
                job={"last_checkpoint_path": found[-1]["path"] if found else None}, checkpoints_on_disk=found
            )
        )

    def _on_log(self, ev: LogEvent) -> Write:
        return Write(events=[event_row(ev.message, level=ev.level, data=ev.data or None)])

    def _on_run_started(self, ev: RunStarted) -> Write:
        """The row's step count, and the run's start as an event."""
        self.total_steps = ev.total_steps
        self.on_cuda = ev.device.startswith("cuda")
        what = f"Training resumed at step {ev.start_step}" if ev.start_step else "Training started"
        msg = (
            f"{what}: {ev.total_steps} steps, {ev.num_examples} examples, {ev.trainable_parameters:,} trainable "
            f"parameters on {ev.device} ({ev.dtype}, engine mode {ev.mode})"
        )
        return Write(job={"total_steps": ev.total_steps}, events=[event_row(msg, data=ev.as_dict())])

    def _on_resolved(self, ev: Resolved) -> Write:
        """A resolution the run made, appended to the job's (the job object shows it and what changed)."""
        return Write(resolution=ev.resolution)

    def _on_step(self, ev: StepEvent) -> Write:
        eng = ev.engine
        metric = {
            "step": ev.step,
            "created_at": utcnow().isoformat(),
            "train_loss": ev.loss,
            "lr": ev.lr,
            "tokens_per_second": ev.tokens_per_second,
            "step_seconds": ev.step_seconds,
            "stall_seconds": ev.stall_seconds,
            "stall_fraction": ev.stall_fraction,
            "gpu_utilization": (1.0 - ev.stall_fraction) if self.on_cuda else None,
            "cpu_optimizer_seconds": float(eng.cpu_optimizer_seconds),
            "bytes_device_to_host": int(eng.bytes_device_to_host),
            "bytes_host_to_device": int(eng.bytes_host_to_device),
        }
        pref = asdict(ev.preference) if ev.preference is not None else {}
        shown = f", preference accuracy={ev.preference.accuracy:.2f}" if ev.preference is not None else ""
        event = event_row(
            f"Step {ev.step}/{ev.total_steps}: training loss={ev.loss:.4f}{shown}",
            type="metrics",
            data={
                "step": ev.step,
                "total_steps": ev.total_steps,
                "train_loss": ev.loss,
                "lr": ev.lr,
                "tokens_per_second": ev.tokens_per_second,
                "stall_fraction": ev.stall_fraction,
                **pref,
            },
        )
        return Write(job={"global_step": ev.step}, metric=metric, events=[event])

    def _on_eval(self, ev: EvalEvent) -> Write:
        pref = (
            {f"valid_{k}": v for k, v in asdict(ev.preference).items()} if ev.preference is not None else {}
        )
        shown = f", preference accuracy={ev.preference.accuracy:.2f}" if ev.preference is not None else ""
        event = event_row(
            f"Step {ev.step}: validation loss={ev.valid_loss:.4f}{shown}",
            type="metrics",
            data={"step": ev.step, "valid_loss": ev.valid_loss, "valid_tokens": ev.valid_tokens, **pref},
        )
        return Write(valid_loss={"step": ev.step, "valid_loss": ev.valid_loss}, events=[event])

    def _on_checkpoint(self, ev: CheckpointSaved) -> Write:
        metrics = {k: v for k, v in ev.metrics.items() if v is not None}
        return Write(
            job={"last_checkpoint_path": ev.path},
            checkpoint={"step": ev.step, "path": ev.path, "metrics": metrics},
            events=[
                event_row(f"Checkpoint saved at step {ev.step}", data={"step": ev.step, "path": ev.path})
            ],
        )

    def _on_checkpoint_removed(self, ev: CheckpointRemoved) -> Write:
        return Write(removed_checkpoint=ev.step)

    def _on_error(self, ev: ErrorEvent) -> Write | None:
        """A full disk is a warning (the job is re-queued to wait off the GPU); any other error ends the job
        as failed, whose one error event the end state writes (job_runner, store.jobs.fail)."""
        message = scrub(ev.message)
        if not (ev.error_type == "DiskFullError" or "No space left on device" in message):
            return None
        message = message.removeprefix("DiskFullError: ")
        data = {"error_type": ev.error_type, "errors": ev.errors[:20], "disk_full": message}
        return Write(events=[event_row(message, level="warning", data=data)])

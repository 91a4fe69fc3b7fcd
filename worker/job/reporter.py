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

import json
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
    GradedSample,
    LogEvent,
    PreferenceMetrics,
    Resolved,
    RewardMetrics,
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
        reward = ev.reward.figures() if ev.reward is not None else {}
        pref = asdict(ev.preference) if ev.preference is not None else {}
        if reward or pref:  # a reinforcement step's rewards, a DPO step's reward margin and accuracy
            metric["method_metrics"] = {**pref, **reward}
        event = event_row(
            f"Step {ev.step}/{ev.total_steps}: training loss={ev.loss:.4f}{_shown(ev.preference, ev.reward)}",
            type="metrics",
            data={
                "step": ev.step,
                "total_steps": ev.total_steps,
                "train_loss": ev.loss,
                "lr": ev.lr,
                "tokens_per_second": ev.tokens_per_second,
                "stall_fraction": ev.stall_fraction,
                **pref,
                **reward,
            },
        )
        return Write(job={"global_step": ev.step}, metric=metric, events=[event])

    def _on_eval(self, ev: EvalEvent) -> Write:
        figures = {**_fields(ev.preference), **(ev.reward.figures() if ev.reward is not None else {})}
        event = event_row(
            _eval_message(ev),
            type="metrics",
            data={
                "step": ev.step,
                "valid_loss": ev.valid_loss,
                "valid_tokens": ev.valid_tokens,
                **{f"valid_{k}": v for k, v in figures.items()},
            },
        )
        events = [event]
        if ev.reward is not None and ev.reward.examples:
            events.append(graded_samples_row(ev.step, ev.reward.examples))
        return Write(valid_loss={"step": ev.step, "valid_loss": ev.valid_loss}, events=events)

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


#: An evaluation's graded samples: at most this many in the event's data, each text cut to this length;
#: the message quotes the first few, shorter.
SAMPLES_KEPT, SAMPLE_CHARS = 8, 2000
SAMPLES_SHOWN, SHOWN_CHARS = 3, 120


def _fields(p: PreferenceMetrics | None) -> dict[str, Any]:
    return asdict(p) if p is not None else {}


def _shown(p: PreferenceMetrics | None, r: RewardMetrics | None) -> str:
    """A step's or evaluation's method figures for its message (nothing for a supervised job)."""
    if r is not None:
        return f", reward mean={r.reward_mean:.2f} (min {r.reward_min:.2f}, max {r.reward_max:.2f})"
    return f", preference accuracy={p.accuracy:.2f}" if p is not None else ""


def _eval_message(ev: EvalEvent) -> str:
    """A reinforcement evaluation shows its reward (its valid_loss is the negative mean reward)."""
    if ev.reward is not None:
        r = ev.reward
        return f"Step {ev.step}: validation reward={r.reward_mean:.2f} ({r.samples} samples)"
    return f"Step {ev.step}: validation loss={ev.valid_loss:.4f}{_shown(ev.preference, None)}"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _quoted(g: GradedSample) -> str:
    """A sample in a message: its reward, the start of its completion, the grader's error flags."""
    errors = f" (errors: {', '.join(g.errors[:4])})" if g.errors else ""
    return f"reward {g.reward:.2f} {json.dumps(_cut(g.completion, SHOWN_CHARS), ensure_ascii=False)}{errors}"


def graded_samples_row(step: int, examples: list[GradedSample]) -> dict[str, Any]:
    """One event with an evaluation's graded samples: what the model wrote and what it scored (texts
    cut, so the row and its message stay bounded)."""
    kept = [
        {
            "prompt": _cut(g.prompt, SAMPLE_CHARS),
            "completion": _cut(g.completion, SAMPLE_CHARS),
            "reward": g.reward,
            "errors": list(g.errors),
        }
        for g in examples[:SAMPLES_KEPT]
    ]
    shown = "; ".join(_quoted(g) for g in examples[:SAMPLES_SHOWN])
    more = f"; {len(examples) - SAMPLES_SHOWN} more" if len(examples) > SAMPLES_SHOWN else ""
    return event_row(
        f"Step {step}: graded samples: {shown}{more}", type="message", data={"step": step, "samples": kept}
    )

"""The tracking sinks' thread: training events to MLflow and W&B without ever holding training up.

:class:`Tracking` is a ``trainer.events`` callback for rank 0 of a job process (worker.job.runner): it
only puts the event on a bounded queue (full: the event is dropped and one warning event says so)
and returns. Its thread hands each event to every :class:`Sink` and asks each to :meth:`Sink.flush`
every ``Settings.tracking_flush_seconds``. A sink that raises is reported once as a warning event and
kept (its next event may go through): a tracking server's trouble is never the job's failure. At the
job's end :meth:`Tracking.close` drains the queue and gives the sinks until a deadline to send what
they hold; what they cannot is left in the job's output folder (``tracking/``).
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.events import EvalEvent, Event, PreferenceMetrics, RewardMetrics, StepEvent

log = logging.getLogger("zenflow.tracking")

#: ``warn(message, data)``: one warning event on the job (worker.job.writer rows, in order).
Warn = Callable[[str, dict[str, Any]], None]

#: The per-step metrics every sink logs, by their names in the job's metrics rows (worker.job.reporter).
STEP_METRICS = ("train_loss", "lr", "tokens_per_second", "step_seconds", "stall_fraction", "tokens")


def step_metrics(ev: StepEvent, on_cuda: bool) -> dict[str, float]:
    """One step's metrics as the trackers get them (``gpu_utilization`` on a GPU only: 1 - stalls)."""
    values = {
        "train_loss": ev.loss,
        "lr": ev.lr,
        "tokens_per_second": ev.tokens_per_second,
        "step_seconds": ev.step_seconds,
        "stall_fraction": ev.stall_fraction,
        "tokens": float(ev.tokens),
    }
    if on_cuda:
        values["gpu_utilization"] = 1.0 - ev.stall_fraction
    values.update(_preference("dpo_", ev.preference))
    values.update(_reward(ev.reward))
    return {k: float(v) for k, v in values.items()}


def eval_metrics(ev: EvalEvent) -> dict[str, float]:
    """An evaluation's metrics: ``valid_loss``, a DPO job's validation rewards and accuracy, a
    reinforcement job's mean validation reward."""
    values = {"valid_loss": float(ev.valid_loss), **_preference("dpo_valid_", ev.preference)}
    if ev.reward is not None:
        values["rft_valid_reward_mean"] = float(ev.reward.reward_mean)
    return values


def _preference(prefix: str, p: PreferenceMetrics | None) -> dict[str, float]:
    """A DPO step's or evaluation's rewards and preference accuracy (none for a supervised job)."""
    if p is None:
        return {}
    return {
        f"{prefix}chosen_reward": p.chosen_reward,
        f"{prefix}rejected_reward": p.rejected_reward,
        f"{prefix}reward_margin": p.reward_margin,
        f"{prefix}accuracy": p.accuracy,
    }


def _reward(r: RewardMetrics | None) -> dict[str, float]:
    """A reinforcement step's rewards, lengths, grader errors and times, and each sub-reward of a multi
    grader as ``rft_sub_reward/<name>`` (none for another method)."""
    if r is None:
        return {}
    values = {
        "rft_reward_mean": r.reward_mean,
        "rft_reward_min": r.reward_min,
        "rft_reward_max": r.reward_max,
        "rft_completion_tokens_mean": r.completion_tokens_mean,
        "rft_grader_errors": float(r.grader_errors),
        "rft_generation_seconds": r.generation_seconds,
        "rft_grading_seconds": r.grading_seconds,
    }
    for name, value in r.sub_rewards.items():
        values[f"rft_sub_reward/{metric_key(name)}"] = value
    return values


def metric_key(name: str) -> str:
    """``name`` in the characters MLflow allows in a metric key (alphanumerics, ``_ - . / space``; the
    rest become ``_``), at most 100 of them (a grader's name is the user's)."""
    cleaned = _KEY_UNSAFE.sub("_", name).strip() or "_"
    return cleaned[:100]


_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /]")


@dataclass
class TrackingContext:
    """What a sink knows about its job beyond the events."""

    job_id: str
    team_id: str
    #: The final model's ``ft:`` id (store.model_ids.job_model_id); checkpoints' ids derive from it.
    model_id: str
    #: The job's output folder; the sinks' own files go under ``tracking/``.
    output_dir: Path
    #: The job's settings as requested (model, files, seed, hyperparameters, engine, resources).
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def tracking_dir(self) -> Path:
        return self.output_dir / "tracking"


class Sink(ABC):
    """One tracking integration of a job; every method runs on the tracking thread."""

    #: The integration's type, as the request names it.
    kind: str = ""

    @abstractmethod
    def handle(self, ev: Event) -> None:
        """Take one training event (buffer it; sending is :meth:`flush`'s)."""

    def flush(self) -> None:  # noqa: B027 - a sink that sends as it goes needs none
        """Send what is buffered, if the server takes it (never raises for a server that is away)."""

    @abstractmethod
    def close(self, deadline: float, *, succeeded: bool) -> None:
        """End the run: send what is left before ``deadline`` (time.monotonic()), else leave it in the
        job's output folder and say so in a warning."""


_STOP = object()


class Tracking:
    """The job's sinks behind one bounded queue and one thread (module docstring)."""

    def __init__(
        self,
        sinks: list[Sink],
        *,
        warn: Warn,
        max_items: int,
        flush_seconds: float,
        close_seconds: float = 0.0,
    ) -> None:
        self.sinks, self.warn, self.flush_seconds = sinks, warn, flush_seconds
        self.close_seconds = close_seconds
        self.dropped = 0
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_items)
        self._failed: set[str] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="zenflow-tracking", daemon=True)
        if sinks:
            self._thread.start()

    def __call__(self, ev: Event) -> None:
        if not self.sinks or self._closed:
            return
        try:
            self._queue.put_nowait(ev)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                self.warn(
                    "Tracking is behind: training events are being dropped for the tracking servers",
                    {"tracking": [s.kind for s in self.sinks]},
                )

    def wrap(self, on_event: Callable[[Event], None]) -> Callable[[Event], None]:
        """``on_event`` then this: the database first, the trackers as they can."""

        def both(ev: Event) -> None:
            on_event(ev)
            self(ev)

        return both

    def _guarded(self, sink: Sink, what: Callable[[], None]) -> None:
        try:
            what()
        except Exception as e:
            log.warning("tracking %s: %s", sink.kind, e, exc_info=True)
            if sink.kind not in self._failed:
                self._failed.add(sink.kind)
                self.warn(
                    f"Tracking ({sink.kind}) failed: {type(e).__name__}; training goes on",
                    {"tracking": sink.kind, "error_type": type(e).__name__},
                )

    def _loop(self) -> None:
        next_flush = time.monotonic() + self.flush_seconds
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, next_flush - time.monotonic()))
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            if isinstance(item, Event):
                for sink in self.sinks:
                    self._guarded(sink, lambda s=sink, e=item: s.handle(e))  # type: ignore[misc]
            if time.monotonic() >= next_flush:
                for sink in self.sinks:
                    self._guarded(sink, sink.flush)
                next_flush = time.monotonic() + self.flush_seconds

    def close(self, *, succeeded: bool, seconds: float | None = None) -> None:
        """Hand the sinks every queued event, then end their runs within ``seconds`` (default
        ``close_seconds``). Idempotent."""
        if self._closed or not self.sinks:
            return
        self._closed = True
        deadline = time.monotonic() + (self.close_seconds if seconds is None else seconds)
        self._queue.put(_STOP)  # after every event already queued (the queue has room: see __call__)
        self._thread.join()
        for sink in self.sinks:
            self._guarded(sink, lambda s=sink: s.close(deadline, succeeded=succeeded))  # type: ignore[misc]

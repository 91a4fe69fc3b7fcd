"""The job process's database writes: in order, in the background, across database outages.

The reporter (:mod:`worker.job.reporter`) turns each training event into a :class:`Write` (the
rows it makes) and hands it to a :class:`ReportWriter`, a thread that writes them in the order given,
several to a transaction when they have piled up. Training never waits on the database: while it is
unreachable the writes wait in memory (at most ``Settings.job_db_buffer_items``; when full, the
training thread waits for room) and the writer retries with backoff on a fresh connection. When the
outage lasts longer than ``Settings.job_db_outage_seconds`` the writer sets ``interrupted``: the
run then stops (checkpoint, exit as interrupted) and what is still unwritten is saved to a spool file in
the job's output directory (:meth:`ReportWriter.save_spool`), written first by the next run of the job.

Each transaction first updates the job row guarded by ``status = running AND worker_hostname = us``
(the heartbeat, and the job columns of its writes): a job re-queued or taken over meanwhile (the reaper,
after a long outage) gets nothing more from this process, which exits at once (``on_lost``).

Writing a :class:`Write` twice is harmless: its events carry their ids from the start, so a batch whose
commit may have gone through before its connection dropped (and a spool that may have been written) is
checked for them first; the other rows are upserts. A step's ``metrics`` event is written only with
the step's first metrics row, so the steps a resumed run replays get no second "Step N" event.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from itertools import islice
from pathlib import Path
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

from contract.job import Resolution
from store import model_ids
from store.db import session_scope
from store.ids import new_id
from store.orm import FineTuningJob, JobCheckpoint, JobEvent, JobStatus, JobStepMetric, utcnow
from worker.errors import is_db_unavailable, public_message
from worker.retry import Backoff

log = logging.getLogger("zenflow.job_runner")

#: Writes to one transaction at most, when they have piled up.
BATCH_WRITES = 256
SPOOL_NAME = ".zenflow-unwritten-reports.jsonl"


class JobLost(Exception):
    """The job row is no longer running on this process's claim."""


class ReportingError(RuntimeError):
    """A write the database refuses for good (not an outage); the message is user-safe."""


def event_row(
    message: str, *, level: str = "info", type: str = "message", data: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A JobEvent's columns, its id and time fixed now (so the event is written once, stamped when it
    happened, whenever the database takes it)."""
    return {
        "id": new_id("ftevent"),
        "created_at": utcnow().isoformat(),
        "message": message,
        "level": level,
        "type": type,
        "data": data,
    }


@dataclass
class Write:
    """The rows of one training event (JSON-able, for the spool)."""

    #: Columns of the job row (the latest value wins within a transaction).
    job: dict[str, Any] = field(default_factory=dict)
    #: JobEvent columns (see :func:`event_row`).
    events: list[dict[str, Any]] = field(default_factory=list)
    #: A JobStepMetric row (``step`` and its columns); when the step already has one (a step replayed
    #: after a resume) the row is updated and ``events`` are not written.
    metric: dict[str, Any] | None = None
    #: ``{"step", "valid_loss"}`` for the step's metrics row; ``events`` skipped when it had one already.
    valid_loss: dict[str, Any] | None = None
    #: A checkpoint saved: ``{"step", "path", "metrics"}`` (upserted by step).
    checkpoint: dict[str, Any] | None = None
    #: The step of a checkpoint deleted (its row goes).
    removed_checkpoint: int | None = None
    #: The complete checkpoints on disk, ``[{"step", "path", "metrics"}]``: rows are made for those
    #: without one, and rows of checkpoints not on disk deleted.
    checkpoints_on_disk: list[dict[str, Any]] | None = None
    #: A resolution the run made (contract.job.Resolution as JSON), appended to the job's resolutions.
    resolution: dict[str, Any] | None = None
    #: From a spool: may have been written already (its event ids are checked first).
    replayed: bool = False


def _ts(value: Any) -> datetime:
    return datetime.fromisoformat(value) if isinstance(value, str) else utcnow()


#: The columns of a metrics row a Write may set, with the value when it sets none.
_METRIC_COLUMNS: dict[str, Any] = {
    "train_loss": None,
    "valid_loss": None,
    "lr": None,
    "tokens_per_second": None,
    "step_seconds": 0.0,
    "stall_seconds": 0.0,
    "stall_fraction": 0.0,
    "gpu_utilization": None,
    "cpu_optimizer_seconds": 0.0,
    "bytes_device_to_host": 0,
    "bytes_host_to_device": 0,
    "method_metrics": None,
}


def _append_resolutions(s: Session, job_id: str, made: list[dict[str, Any]]) -> None:
    """The run's new resolutions after the job's (one written already, by a batch whose commit went
    through before its connection dropped, is not added twice)."""
    if not made:
        return
    current = list(s.scalar(select(FineTuningJob.resolutions).where(FineTuningJob.id == job_id)) or [])
    for r in (Resolution.model_validate(m) for m in made):
        if r not in current:
            current.append(r)
    s.execute(
        update(FineTuningJob)
        .where(FineTuningJob.id == job_id)
        .values(resolutions=current)
        .execution_options(synchronize_session=False)
    )


def apply_writes(s: Session, job_id: str, hostname: str, batch: list[Write], *, maybe_written: bool) -> None:
    """Write ``batch`` in order in the session's transaction, in a few statements whatever its size (a
    transaction that must fit between two dropped connections); JobLost when the job is no longer ours."""
    _update_job_row(s, job_id, hostname, batch)
    _append_resolutions(s, job_id, [w.resolution for w in batch if w.resolution is not None])
    if maybe_written:
        batch = _unwritten(s, batch)
    rows = _StepRows(job_id, _known_steps(s, job_id, batch))
    events: list[dict[str, Any]] = []
    for w in batch:
        first_time = rows.take(w)
        events += _apply_checkpoints(s, job_id, w)
        if first_time:
            events += w.events
    rows.write(s)
    if events:  # one statement, rows in the order given: their seq keeps the order of the events
        s.execute(
            insert(JobEvent),
            [{"job_id": job_id, "data": None, **e, "created_at": _ts(e.get("created_at"))} for e in events],
        )


def _update_job_row(s: Session, job_id: str, hostname: str, batch: list[Write]) -> None:
    """The heartbeat and the batch's job columns, guarded by our claim; JobLost when it is not ours."""
    values: dict[str, Any] = {}
    for w in batch:
        values.update(w.job)
    res = s.execute(
        update(FineTuningJob)
        .where(
            FineTuningJob.id == job_id,
            FineTuningJob.status == JobStatus.running.value,
            FineTuningJob.worker_hostname == hostname,
        )
        .values(heartbeat_at=utcnow(), **values)
        .execution_options(synchronize_session=False)
    )
    assert isinstance(res, CursorResult)
    if res.rowcount != 1:
        raise JobLost(job_id)


def _unwritten(s: Session, batch: list[Write]) -> list[Write]:
    """The writes none of whose events is in the database (a commit that may have gone through)."""
    ids = [e["id"] for w in batch for e in w.events]
    done = set(s.scalars(select(JobEvent.id).where(JobEvent.id.in_(ids)))) if ids else set()
    return [w for w in batch if not any(e["id"] in done for e in w.events)]


def _known_steps(s: Session, job_id: str, batch: list[Write]) -> dict[int, float | None]:
    """step -> valid_loss of the metrics rows there already, of the steps the batch writes."""
    steps = {w.metric["step"] for w in batch if w.metric} | {
        w.valid_loss["step"] for w in batch if w.valid_loss
    }
    if not steps:
        return {}
    return {
        r.step: r.valid_loss
        for r in s.execute(
            select(JobStepMetric.step, JobStepMetric.valid_loss).where(
                JobStepMetric.job_id == job_id, JobStepMetric.step.in_(steps)
            )
        )
    }


class _StepRows:
    """A batch's metrics rows: those it adds, and the changes to rows there already (``known``)."""

    def __init__(self, job_id: str, known: dict[int, float | None]) -> None:
        self.job_id, self.known = job_id, known
        self.added: dict[int, dict[str, Any]] = {}
        self.changed: dict[int, dict[str, Any]] = {}

    def take(self, w: Write) -> bool:
        """Take ``w``'s metrics and validation loss; whether its events are written (its step's first
        metrics, or the step's first validation loss)."""
        first_time = True
        if w.metric is not None:
            first_time = self._metric(w.metric)
        if w.valid_loss is not None:
            first_time = self._valid_loss(w.valid_loss["step"], w.valid_loss["valid_loss"], first_time)
        return first_time

    def _metric(self, metric: dict[str, Any]) -> bool:
        step = metric["step"]
        cols = {k: v for k, v in metric.items() if k in _METRIC_COLUMNS}
        if step in self.added:
            self.added[step].update(cols)
            return False
        if step in self.known:  # replayed after a resume: new figures, no second event
            self.changed.setdefault(step, {}).update(cols)
            return False
        self.added[step] = {
            **_METRIC_COLUMNS,
            **cols,
            "job_id": self.job_id,
            "step": step,
            "created_at": _ts(metric.get("created_at")),
        }
        return True

    def _valid_loss(self, step: int, loss: Any, first_time: bool) -> bool:
        if step in self.added:
            first_time = self.added[step]["valid_loss"] is None
            self.added[step]["valid_loss"] = loss
        elif step in self.known:
            first_time = self.known[step] is None
            self.known[step] = loss
            self.changed.setdefault(step, {})["valid_loss"] = loss
        return first_time

    def write(self, s: Session) -> None:
        if self.added:
            s.execute(insert(JobStepMetric), list(self.added.values()))
        for step, cols in self.changed.items():
            s.execute(
                update(JobStepMetric)
                .where(JobStepMetric.job_id == self.job_id, JobStepMetric.step == step)
                .values(**cols)
                .execution_options(synchronize_session=False)
            )


def _apply_checkpoints(s: Session, job_id: str, w: Write) -> list[dict[str, Any]]:
    """``w``'s checkpoint rows: saved, removed, synced with the disk; the events the sync makes."""
    if w.checkpoint is not None:
        _save_checkpoint_row(s, job_id, w.checkpoint)
    if w.removed_checkpoint is not None:
        s.execute(
            delete(JobCheckpoint).where(
                JobCheckpoint.job_id == job_id, JobCheckpoint.step_number == w.removed_checkpoint
            )
        )
        model_ids.forget_checkpoint(s, job_id, w.removed_checkpoint)
    if w.checkpoints_on_disk is not None:
        return _sync_checkpoints(s, job_id, w.checkpoints_on_disk)
    return []


def _save_checkpoint_row(s: Session, job_id: str, ck: dict[str, Any]) -> None:
    row = s.execute(
        select(JobCheckpoint).where(JobCheckpoint.job_id == job_id, JobCheckpoint.step_number == ck["step"])
    ).scalar_one_or_none()
    model_id = model_ids.register_checkpoint(s, job_id, ck["step"], ck["path"])
    if row is None:
        s.add(
            JobCheckpoint(
                job_id=job_id,
                step_number=ck["step"],
                path=ck["path"],
                fine_tuned_model_checkpoint=model_id,
                metrics=ck.get("metrics") or {},
            )
        )
    else:
        row.path, row.fine_tuned_model_checkpoint = ck["path"], model_id
        row.metrics = ck.get("metrics") or {}
    s.flush()


def _sync_checkpoints(s: Session, job_id: str, on_disk: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for the checkpoints on disk, none for the others; an event (row) for each registered."""
    by_step = {c["step"]: c for c in on_disk}
    rows = {r.step_number: r for r in s.scalars(select(JobCheckpoint).where(JobCheckpoint.job_id == job_id))}
    for step, row in rows.items():
        if step not in by_step:
            s.delete(row)
            model_ids.forget_checkpoint(s, job_id, step)
    s.flush()
    events = []
    for step, ck in sorted(by_step.items()):
        if step not in rows:
            _save_checkpoint_row(s, job_id, ck)
            events.append(
                event_row(
                    f"Checkpoint at step {step} found on disk; registered",
                    data={"step": step, "path": ck["path"]},
                )
            )
        elif rows[step].path != ck["path"]:
            _save_checkpoint_row(s, job_id, ck)
    return events


class ReportWriter(threading.Thread):
    """Writes :class:`Write` records to the database in order, in the background (module docstring)."""

    def __init__(
        self,
        url: str,
        job_id: str,
        hostname: str,
        *,
        outage_seconds: float,
        max_items: int,
        on_lost: Callable[[], None],
        interrupted: threading.Event | None = None,
    ) -> None:
        super().__init__(name=f"zenflow-writer-{job_id}", daemon=True)
        self.url, self.job_id, self.hostname = url, job_id, hostname
        self.outage_seconds, self.max_items, self.on_lost = outage_seconds, max_items, on_lost
        #: Set when the database has been unreachable for longer than outage_seconds.
        self.interrupted = interrupted or threading.Event()
        self.fatal: BaseException | None = None
        self.lost = False
        self._items: deque[Write] = deque()
        self._cond = threading.Condition()
        self._closing = threading.Event()
        self._maybe_written = False
        self._spool: Path | None = None
        self._spooled = 0  # replayed writes still to be written

    # -- the training thread's side --

    def put(self, w: Write) -> None:
        """Queue ``w``; waits while the buffer is full (until the database is back or the outage is
        past its window). Raises ReportingError once a write was refused for good."""
        with self._cond:
            while (
                len(self._items) >= self.max_items
                and self.fatal is None
                and not self.lost
                and not self.interrupted.is_set()
                and self.is_alive()
            ):
                self._cond.wait(1.0)
            if self.fatal is not None:
                raise ReportingError(public_message(self.fatal)) from self.fatal
            self._items.append(w)
            self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._items)

    def flush(self, timeout: float | None = None, *, past_interruption: bool = False) -> bool:
        """Wait until everything queued is written; False when ``timeout`` passed first, the writer gave
        up (a refused write, a lost job) or, unless ``past_interruption``, the outage passed its window."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._items and self.fatal is None and not self.lost and self.is_alive():
                if self.interrupted.is_set() and not past_interruption:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(1.0 if left is None else min(1.0, left))
            return not self._items

    def close(self, timeout: float = 15.0) -> list[Write]:
        """Stop after the current attempt; the writes left unwritten."""
        self._closing.set()
        with self._cond:
            self._cond.notify_all()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
        with self._cond:
            return list(self._items)

    # -- the spool --

    def load_spool(self, path: Path) -> int:
        """Queue the writes a previous run of the job saved to ``path`` (before anything else); the spool
        file is deleted once they are written. The number loaded."""
        self._spool = path
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            return 0
        loaded = []
        for i, line in enumerate(lines, 1):
            try:
                loaded.append(Write(**{**json.loads(line), "replayed": True}))
            except (ValueError, TypeError):
                log.warning("job %s: %s line %d is not a write; skipped", self.job_id, path, i)
        with self._cond:
            self._items.extendleft(reversed(loaded))
            self._spooled += len(loaded)
            self._cond.notify_all()
        if not loaded:
            path.unlink(missing_ok=True)
        return len(loaded)

    def save_spool(self, path: Path, writes: list[Write]) -> bool:
        """Save ``writes`` (those :meth:`close` returned) for the next run of the job; False when the
        file cannot be written (they are lost then)."""
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        try:
            with tmp.open("w") as fh:
                for w in writes:
                    fh.write(json.dumps(asdict(w), default=str) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError:
            log.exception("job %s: could not save %d unwritten reports", self.job_id, len(writes))
            tmp.unlink(missing_ok=True)
            return False
        return True

    # -- the writer thread --

    def run(self) -> None:
        backoff = Backoff(0.1, 5.0)
        outage_since: float | None = None
        size = BATCH_WRITES  # halved after each failed attempt: a batch must fit between two drops
        isolate = 0  # after a refused batch: write one at a time until past the write refused
        while not self._closing.is_set():
            batch = self._next_batch(1 if isolate else size)
            if batch is None:
                return
            try:
                self._write(batch)
            except JobLost:
                self._lost()
                return
            except Exception as e:
                if is_db_unavailable(e):
                    size = max(1, len(batch) // 2)
                    outage_since = self._unavailable(e, outage_since)
                    self._closing.wait(backoff.next())
                    continue
                if len(batch) > 1:
                    isolate = len(batch)
                    continue
                self._refused(e)
                return
            if outage_since is not None:
                log.warning(
                    "job %s: database back after %.1f s", self.job_id, time.monotonic() - outage_since
                )
            self._done(batch)
            self._maybe_written, outage_since, isolate = False, None, max(0, isolate - 1)
            size = min(BATCH_WRITES, size * 2)
            backoff.reset()

    def _next_batch(self, size: int) -> list[Write] | None:
        """The next ``size`` writes at most, waiting for one; None once closing."""
        with self._cond:
            while not self._items and not self._closing.is_set():
                self._cond.wait()
            if self._closing.is_set():
                return None
            return list(islice(self._items, size))

    def _write(self, batch: list[Write]) -> None:
        maybe = self._maybe_written or any(w.replayed for w in batch)
        with session_scope(self.url) as s:
            apply_writes(s, self.job_id, self.hostname, batch, maybe_written=maybe)

    def _lost(self) -> None:
        log.error("job %s is no longer ours: writing nothing more", self.job_id)
        with self._cond:
            self.lost = True
            self._cond.notify_all()
        self.on_lost()

    def _unavailable(self, e: Exception, outage_since: float | None) -> float:
        """An attempt that met an outage: said when it starts, the run interrupted once it lasts past
        ``outage_seconds``; when the outage started."""
        self._maybe_written = True  # the commit may have gone through before the drop
        now = time.monotonic()
        if outage_since is None:
            log.warning("job %s: %s; %d reports wait", self.job_id, public_message(e), len(self._items))
            return now
        if now - outage_since > self.outage_seconds and not self.interrupted.is_set():
            log.error(
                "job %s: database unavailable for more than %g s: interrupting the run",
                self.job_id,
                self.outage_seconds,
            )
            self.interrupted.set()
            with self._cond:
                self._cond.notify_all()
        return outage_since

    def _refused(self, e: Exception) -> None:
        log.error("job %s: the database refused a report: %s", self.job_id, e)
        with self._cond:
            self.fatal = e
            self._cond.notify_all()

    def _done(self, batch: list[Write]) -> None:
        with self._cond:
            for _ in batch:
                self._items.popleft()
            replayed = sum(1 for w in batch if w.replayed)
            self._spooled -= replayed
            self._cond.notify_all()
        if replayed and self._spooled <= 0 and self._spool is not None:
            self._spool.unlink(missing_ok=True)

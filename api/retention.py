"""The storage lifecycle of job outputs: the retention policy for finished jobs, and the purge of a
finished job's outputs.

While a job runs, the trainer keeps its newest ``keep_checkpoints`` checkpoints (trainer.run.loop). Once
a job is finished (succeeded, failed, cancelled) nothing writes to its output directory again, and
:func:`apply_retention` holds it to the policy: the newest ``keep`` complete checkpoints plus the
final model (``final/``, whose weights are hard links, so removing the checkpoint it came from frees
only the training state), leftovers of interrupted writes removed, and checkpoint rows matching the
directories (a row whose directory is gone is deleted, its model id with it, so the checkpoints list
never names a missing path; a kept checkpoint without a row gets one, and its ``ft:`` id). :func:`sweep` applies it to every finished job (the API runs it periodically; ``zenflow
storage sweep`` once).

:func:`purge_job_outputs` removes all of a finished job's outputs (checkpoints, final model, run
result), its checkpoint rows and its model ids (store.model_ids), and records an event:
``zenflow jobs purge JOB_ID``. (``DELETE /v1/models/{id}`` removes one model's folder: api.routers.models.) The job row, its events, metrics and result files stay (a result file
is deleted on its own, ``DELETE /v1/files/{id}``). Only directories under ``jobs_dir`` are ever
removed, whatever a row says.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from store import model_ids
from store.jobs import add_event
from store.orm import FineTuningJob, JobCheckpoint, JobStatus
from store.usage import OUTPUT_SIZES, directory_bytes
from trainer.run.checkpoint import CheckpointInfo, cleanup_partial, list_checkpoints

log = logging.getLogger(__name__)

TERMINAL = tuple(s.value for s in JobStatus if s.terminal)


class JobNotFinishedError(Exception):
    """The job may still write to its outputs (queued or running): they are not removed."""


class ForeignPathError(Exception):
    """The job's output directory is not under this service's jobs_dir: it is not removed."""


@dataclass
class Pruned:
    job_id: str
    removed: list[str] = field(default_factory=list)
    rows_deleted: int = 0
    rows_added: int = 0
    freed_bytes: int = 0


def _inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


def _output_dir(job: FineTuningJob, jobs_dir: Path) -> Path | None:
    """The job's output directory when it is a directory under ``jobs_dir``, else None."""
    if not job.output_dir:
        return None
    out = Path(job.output_dir)
    if not _inside(out, jobs_dir) or out.resolve() == jobs_dir.resolve():
        log.warning("job %s: output_dir %s is not under %s; left alone", job.id, out, jobs_dir)
        return None
    return out


def _lock_finished(session: Session, job_id: str, *, skip_locked: bool = False) -> FineTuningJob | None:
    stmt = select(FineTuningJob).where(FineTuningJob.id == job_id).with_for_update(skip_locked=skip_locked)
    return session.execute(stmt).scalar_one_or_none()


def apply_retention(session: Session, job: FineTuningJob, *, keep: int, jobs_dir: Path) -> Pruned:
    """Hold a finished job (row locked by the caller) to the policy; the caller commits."""
    if not JobStatus(job.status).terminal:
        raise JobNotFinishedError(f"job {job.id} is {job.status}")
    result = Pruned(job.id)
    out = _output_dir(job, jobs_dir)
    if out is None:
        return result
    kept = _prune_files(out, keep, result) if out.is_dir() else []
    _sync_checkpoint_rows(session, job.id, kept, result)
    if result.removed:
        add_event(
            session,
            job.id,
            f"Retention: removed {len(result.removed)} old checkpoint(s), kept the newest {keep} and the final model",
            data={"removed": result.removed, "freed_bytes": result.freed_bytes},
        )
    return result


def _prune_files(out: Path, keep: int, result: Pruned) -> list[CheckpointInfo]:
    """Partial writes and all but the newest ``keep`` checkpoints removed from ``out`` (into
    ``result``); the checkpoints kept."""
    before = directory_bytes(out)
    result.removed += [str(p) for p in cleanup_partial(out)]
    checkpoints = list_checkpoints(out)
    split = max(0, len(checkpoints) - keep)
    for ck in checkpoints[:split]:
        shutil.rmtree(ck.path, ignore_errors=True)
        result.removed.append(str(ck.path))
    if result.removed:
        result.freed_bytes = max(0, before - directory_bytes(out))
        OUTPUT_SIZES.forget(out)
    return checkpoints[split:]


def _sync_checkpoint_rows(session: Session, job_id: str, kept: list[CheckpointInfo], result: Pruned) -> None:
    """The job's checkpoint rows made to match the checkpoints ``kept`` on disk (counted in ``result``)."""
    rows = {
        r.step_number: r for r in session.scalars(select(JobCheckpoint).where(JobCheckpoint.job_id == job_id))
    }
    for step, row in rows.items():
        if step not in {ck.step for ck in kept}:
            session.delete(row)
            model_ids.forget_checkpoint(session, job_id, step)
            result.rows_deleted += 1
    for ck in kept:  # a checkpoint written while its row could not be (the database was away)
        if ck.step not in rows:
            metrics = ck.manifest.get("metrics")
            model_id = model_ids.register_checkpoint(session, job_id, ck.step, str(ck.path))
            session.add(
                JobCheckpoint(
                    job_id=job_id,
                    step_number=ck.step,
                    path=str(ck.path),
                    fine_tuned_model_checkpoint=model_id,
                    metrics=metrics if isinstance(metrics, dict) else {},
                )
            )
            result.rows_added += 1


def sweep(session_factory: Callable[[], Session], *, keep: int, jobs_dir: Path) -> list[Pruned]:
    """:func:`apply_retention` on every finished job with outputs, one transaction per job; jobs
    another process holds locked right now are skipped (they are done by the next sweep)."""
    with session_factory() as session:
        ids = session.scalars(
            select(FineTuningJob.id).where(
                FineTuningJob.status.in_(TERMINAL), FineTuningJob.output_dir.is_not(None)
            )
        ).all()
    done: list[Pruned] = []
    for job_id in ids:
        with session_factory() as session:
            try:
                job = _lock_finished(session, job_id, skip_locked=True)
                if job is None or not JobStatus(job.status).terminal:
                    continue
                pruned = apply_retention(session, job, keep=keep, jobs_dir=jobs_dir)
                session.commit()
            except Exception:
                session.rollback()
                log.exception("retention: job %s", job_id)
                continue
        if pruned.removed or pruned.rows_deleted or pruned.rows_added:
            log.info(
                "retention: job %s: removed %d path(s) (%d bytes), deleted %d row(s), added %d",
                job_id,
                len(pruned.removed),
                pruned.freed_bytes,
                pruned.rows_deleted,
                pruned.rows_added,
            )
            done.append(pruned)
    return done


def purge_job_outputs(session: Session, job_id: str, *, jobs_dir: Path, team_id: str | None = None) -> Pruned:
    """Remove a finished job's checkpoints, final model and run result, and its checkpoint rows;
    commits. Raises LookupError for an unknown job (or another team's, with ``team_id``),
    :class:`JobNotFinishedError` for one that is queued or running, :class:`ForeignPathError` for
    one whose output directory is not under ``jobs_dir``."""
    job = _lock_finished(session, job_id)
    if job is None or (team_id is not None and job.team_id != team_id):
        raise LookupError(f"no such fine-tuning job: {job_id}")
    if not JobStatus(job.status).terminal:
        raise JobNotFinishedError(f"job {job.id} is {job.status}; cancel it first, or wait until it finishes")
    result = Pruned(job.id)
    out = _output_dir(job, jobs_dir)
    if out is None and job.output_dir:
        raise ForeignPathError(
            f"job {job.id}: output directory {job.output_dir} is not under {jobs_dir}; not removed"
        )
    if out is not None and out.exists():
        result.freed_bytes = directory_bytes(out)
        shutil.rmtree(out)  # an error here leaves the rows: nothing claims to be gone that is not
        result.removed.append(str(out))
        OUTPUT_SIZES.forget(out)
    rows = session.scalars(select(JobCheckpoint).where(JobCheckpoint.job_id == job.id)).all()
    for row in rows:
        session.delete(row)
    model_ids.forget_job_models(session, job.id)
    result.rows_deleted = len(rows)
    add_event(
        session,
        job.id,
        f"Outputs removed (checkpoints and final model): {result.freed_bytes} bytes freed",
        data={"removed": result.removed, "freed_bytes": result.freed_bytes},
    )
    session.commit()
    return result

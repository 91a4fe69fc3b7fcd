"""Run one job from the database: ``python -m trainer.job_runner JOB_ID``.

The worker task spawns this as a subprocess (a killable PID, CUDA initialised only here). It loads the
job and file rows, builds the JobSpec (:func:`trainer.spec.spec_from_job`), runs
:func:`trainer.loop.run_training` with a database reporter and writes the outcome:

- events become ``fine_tuning_job_events`` rows (a ``metrics`` event per step, messages for
  validation, resume, evaluation, checkpoints, errors), each step a ``fine_tuning_job_step_metrics``
  row, each checkpoint a ``fine_tuning_job_checkpoints`` row (removed again when the checkpoint is
  pruned); the job row gets total_steps, resolved_hyperparameters, global_step, last_checkpoint_path;
- a monitor thread writes ``heartbeat_at`` every ``heartbeat_interval_seconds`` and polls
  ``cancel_requested`` (and whether the job is still ours) every ~1 s; the loop sees it between steps;
- the end state: succeeded (``fine_tuned_model`` = the final model directory, ``trained_tokens``),
  cancelled, or failed with ``error = {code, message, param}``; data errors name the file param.

Exit codes: 0 the job reached a terminal state; 75 preempted by SIGTERM (checkpoint written, job left
running for the worker to re-queue, attempt not counted); 3 the job is not ours: already claimed
elsewhere, or taken away while running (re-queued by the reaper, finished elsewhere), in which case
the process exits at once without writing more (another process may own the output directory); any other
exit (a crash, a signal) leaves the job running for the worker or the reaper to re-queue.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from store.db import session_scope
from store.jobs import add_event, lock_job, set_status
from store.models import File, FineTuningJob, JobCheckpoint, JobStatus, JobStepMetric, utcnow
from store.results import add_results_file
from store.settings import Settings, get_settings

log = logging.getLogger("zenflow.job_runner")

EXIT_DONE = 0
EXIT_LOST = 3
EXIT_PREEMPTED = 75
HOSTNAME_ENV = "ZENFLOW_WORKER_HOSTNAME"


def runner_hostname() -> str:
    """This process's claim on a job: the worker's nodename (from the env) or host:pid standalone."""
    return os.environ.get(HOSTNAME_ENV) or f"runner@{socket.gethostname()}:{os.getpid()}"


class JobMonitor(threading.Thread):
    """Heartbeats and cancel polling for one running job, in the background."""

    def __init__(self, job_id: str, url: str, hostname: str, heartbeat_interval: float, poll_interval: float = 1.0):
        super().__init__(name=f"zenflow-monitor-{job_id}", daemon=True)
        self.job_id, self.url, self.hostname = job_id, url, hostname
        self.heartbeat_interval = heartbeat_interval
        self.poll_interval = min(poll_interval, heartbeat_interval)
        self.cancel = threading.Event()
        self.lost = threading.Event()
        self.preempted = threading.Event()
        self._stop_event = threading.Event()

    def should_stop(self) -> bool:
        return self.cancel.is_set() or self.preempted.is_set()

    def beat(self) -> None:
        with session_scope(self.url) as s:
            s.execute(
                update(FineTuningJob)
                .where(FineTuningJob.id == self.job_id, FineTuningJob.worker_hostname == self.hostname)
                .values(heartbeat_at=utcnow())
            )

    def poll(self) -> None:
        with session_scope(self.url) as s:
            row = s.execute(
                select(FineTuningJob.status, FineTuningJob.cancel_requested, FineTuningJob.worker_hostname).where(
                    FineTuningJob.id == self.job_id
                )
            ).one_or_none()
        if row is None or row.status != JobStatus.running.value or row.worker_hostname != self.hostname:
            # Re-queued (or finished) elsewhere: another process may own the output directory now,
            # so stop at once without writing anything more.
            self.lost.set()
            log.error("job %s is no longer ours (%s on %s): exiting", self.job_id,
                      row.status if row else "deleted", row.worker_hostname if row else None)
            os._exit(EXIT_LOST)
        if row.cancel_requested:
            self.cancel.set()

    def run(self) -> None:
        last_beat = 0.0
        while not self._stop_event.is_set():
            try:
                now = time.monotonic()
                if now - last_beat >= self.heartbeat_interval:
                    self.beat()
                    last_beat = now
                self.poll()
            except Exception:  # a database hiccup: try again next round
                log.exception("job monitor: database error")
            self._stop_event.wait(self.poll_interval)

    def stop(self) -> None:
        """Stop polling and wait for the thread (before writing the end state: a poll that saw
        our own terminal write would take it for a lost job)."""
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(30)


class DBReporter:
    """The on_event callback: training events -> database rows (one short transaction per event)."""

    def __init__(self, job_id: str, url: str, hostname: str) -> None:
        self.job_id, self.url, self.hostname = job_id, url, hostname
        self.total_steps: int | None = None
        self.on_cuda = False

    def __call__(self, ev: Any) -> None:
        handler = getattr(self, f"_on_{ev.type}", None)
        if handler is not None:
            with session_scope(self.url) as s:
                handler(s, ev)

    def _job_update(self, s: Any, **values: Any) -> None:
        s.execute(update(FineTuningJob).where(FineTuningJob.id == self.job_id).values(**values))

    def _on_log(self, s: Any, ev: Any) -> None:
        add_event(s, self.job_id, ev.message, level=ev.level, data=ev.data or None)

    def _on_run_started(self, s: Any, ev: Any) -> None:
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

    def _on_step(self, s: Any, ev: Any) -> None:
        eng = ev.engine or {}
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
                cpu_optimizer_seconds=float(eng.get("cpu_optimizer_seconds") or 0.0),
                bytes_device_to_host=int(eng.get("bytes_device_to_host") or 0),
                bytes_host_to_device=int(eng.get("bytes_host_to_device") or 0),
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

    def _on_eval(self, s: Any, ev: Any) -> None:
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

    def _on_checkpoint(self, s: Any, ev: Any) -> None:
        row = s.execute(
            select(JobCheckpoint).where(JobCheckpoint.job_id == self.job_id, JobCheckpoint.step_number == ev.step)
        ).scalar_one_or_none()
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

    def _on_checkpoint_removed(self, s: Any, ev: Any) -> None:
        row = s.execute(
            select(JobCheckpoint).where(JobCheckpoint.job_id == self.job_id, JobCheckpoint.step_number == ev.step)
        ).scalar_one_or_none()
        if row is not None:
            s.delete(row)

    def _on_error(self, s: Any, ev: Any) -> None:
        add_event(s, self.job_id, ev.message, level="error", data={"error_type": ev.error_type, "errors": ev.errors[:20]})


def _finish(
    url: str,
    job_id: str,
    hostname: str,
    status: JobStatus,
    *,
    message: str,
    error: dict[str, Any] | None = None,
    results_dir: Path | None = None,
    **values: Any,
) -> bool:
    """Write the end state if the job is still ours; False when it was taken away meanwhile.

    With ``results_dir`` (on success) the job's metrics CSV becomes a ``fine-tune-results`` file there,
    listed in ``result_files``, in the same transaction; a file that cannot be written is logged and
    left out (the model is what the job was for)."""
    with session_scope(url) as s:
        job = lock_job(s, job_id)
        if job is None or job.status != JobStatus.running.value or job.worker_hostname != hostname:
            return False
        for k, v in values.items():
            setattr(job, k, v)
        job.heartbeat_at = utcnow()
        if results_dir is not None:
            try:
                add_results_file(s, job, results_dir)
            except OSError:
                log.exception("job %s: could not write its results file", job_id)
        set_status(s, job, status, message=message, error=error)
    return True


def _claim_standalone(job: FineTuningJob, hostname: str, settings: Settings, s: Any) -> bool:
    """When run by hand (no worker claimed the job): claim a queued job the way the worker does."""
    if job.status == JobStatus.running.value and job.worker_hostname == hostname:
        return True
    if job.status not in (JobStatus.queued.value, JobStatus.validating_files.value):
        return False
    if job.attempts >= settings.max_job_attempts:
        set_status(s, job, JobStatus.failed, message="Job failed: too many attempts",
                   error={"code": "max_attempts_exceeded", "message": "too many attempts", "param": None})
        return False
    job.attempts += 1
    job.worker_hostname = hostname
    job.heartbeat_at = utcnow()
    set_status(s, job, JobStatus.running, message=f"Attempt {job.attempts} started on {hostname}")
    return True


def run_job_process(job_id: str, *, settings: Settings | None = None) -> int:
    """Run the job to an end state; see the module docstring for the exit codes."""
    from trainer.spec import spec_from_job

    settings = settings or get_settings()
    url = settings.resolved_database_url
    hostname = runner_hostname()
    with session_scope(url) as s:
        job = lock_job(s, job_id)
        if job is None:
            log.error("job %s not found", job_id)
            return EXIT_DONE
        if JobStatus(job.status).terminal:
            return EXIT_DONE
        if not _claim_standalone(job, hostname, settings, s):
            log.warning("job %s is %s on %s: not ours", job_id, job.status, job.worker_hostname)
            return EXIT_LOST
        training = s.get(File, job.training_file_id)
        validation = s.get(File, job.validation_file_id) if job.validation_file_id else None
        output_dir = Path(job.output_dir) if job.output_dir else settings.resolved_jobs_dir / job.id
        job.output_dir = str(output_dir)
        fields = dict(
            model=job.model,
            training_file=training.storage_path if training else "",
            validation_file=validation.storage_path if validation else None,
            hyperparameters=job.hyperparameters,
            engine=job.engine,
            seed=job.seed,
            output_dir=output_dir,
        )
        paths = {str(Path(p)): name for p, name in ((fields["training_file"], "training_file"),
                                                     (fields["validation_file"], "validation_file")) if p}

    try:
        spec = spec_from_job(**fields)
    except Exception as e:
        _finish(url, job_id, hostname, JobStatus.failed, message=f"Invalid job: {e}",
                error={"code": "invalid_job", "message": str(e), "param": None})
        return EXIT_DONE

    monitor = JobMonitor(job_id, url, hostname, settings.heartbeat_interval_seconds)
    monitor.start()
    previous = signal.signal(signal.SIGTERM, lambda *_: monitor.preempted.set())
    try:
        return _run(spec, job_id, url, hostname, monitor, paths, settings.resolved_files_dir)
    finally:
        signal.signal(signal.SIGTERM, previous)
        monitor.stop()


def _run(
    spec: Any, job_id: str, url: str, hostname: str, monitor: JobMonitor, paths: dict[Any, str], files_dir: Path
) -> int:
    from trainer.data import DatasetValidationError
    from trainer.loop import run_training
    from trainer.models import UnknownModelError
    from trainer.telemetry import track_job

    try:
        try:
            # Prometheus telemetry of this run (trainer.telemetry) sees every event after the database.
            with track_job(job_id, base_model=spec.model, mode=spec.engine.mode) as tj:
                result = run_training(spec, on_event=tj.wrap(DBReporter(job_id, url, hostname)),
                                      should_cancel=monitor.should_stop)
        finally:
            monitor.stop()
    except DatasetValidationError as e:
        param = paths.get(str(Path(e.path)), "training_file")
        _finish(url, job_id, hostname, JobStatus.failed, message=f"Invalid {param}: {e}",
                error={"code": f"invalid_{param}", "message": str(e), "param": param})
        return EXIT_DONE
    except UnknownModelError as e:
        _finish(url, job_id, hostname, JobStatus.failed, message=str(e),
                error={"code": "model_not_found", "message": str(e), "param": "model"})
        return EXIT_DONE
    except Exception as e:
        log.exception("job %s failed", job_id)
        msg = f"{type(e).__name__}: {e}"
        if not monitor.lost.is_set():
            _finish(url, job_id, hostname, JobStatus.failed, message=f"Training failed: {msg}",
                    error={"code": "training_error", "message": msg, "param": None})
        return EXIT_LOST if monitor.lost.is_set() else EXIT_DONE
    if monitor.lost.is_set():
        return EXIT_LOST
    if result.cancelled:
        if monitor.cancel.is_set():
            _finish(url, job_id, hostname, JobStatus.cancelled, message=f"Job cancelled at step {result.steps}")
            return EXIT_DONE
        return EXIT_PREEMPTED
    ok = _finish(
        url,
        job_id,
        hostname,
        JobStatus.succeeded,
        message=f"Job succeeded: {result.steps} steps, final model at {result.final_model_dir}",
        fine_tuned_model=result.final_model_dir,
        trained_tokens=result.trained_tokens,
        global_step=result.steps,
        results_dir=files_dir,
    )
    return EXIT_DONE if ok else EXIT_LOST


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.job_runner", description="Run one job from the database.")
    parser.add_argument("job_id")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_job_process(args.job_id)


if __name__ == "__main__":
    sys.exit(main())

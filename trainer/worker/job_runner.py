"""Run one job from the database: ``python -m trainer.worker.job_runner JOB_ID``.

The worker task spawns this as a subprocess (a killable PID, CUDA initialised only here). It loads the
job and file rows, builds the JobSpec (:func:`trainer.spec.spec_from_job`), runs
:func:`trainer.loop.run_training` with a :class:`~trainer.worker.reporter.DBReporter` (events ->
rows) inside :func:`~trainer.worker.telemetry.track_job` (Prometheus), while a
:class:`~trainer.worker.monitor.JobMonitor` beats the heartbeat and polls for a cancel, and writes the
end state through :mod:`store.jobs`: succeeded (``fine_tuned_model`` = the final model directory,
``trained_tokens``, the metrics CSV as a result file), cancelled, or failed with ``error = {code,
message, param}``; data errors name the file param.

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from store import jobs
from store.db import session_scope
from store.models import File, FineTuningJob, JobStatus, utcnow
from store.results import add_results_file
from store.settings import Settings, get_settings
from trainer.worker.monitor import EXIT_LOST, JobMonitor
from trainer.worker.reporter import DBReporter

log = logging.getLogger("zenflow.job_runner")

EXIT_DONE = 0
EXIT_PREEMPTED = 75
HOSTNAME_ENV = "ZENFLOW_WORKER_HOSTNAME"
#: What the worker task runs with ``python -m``.
JOB_RUNNER_MODULE = "trainer.worker.job_runner"

__all__ = ["EXIT_DONE", "EXIT_LOST", "EXIT_PREEMPTED", "HOSTNAME_ENV", "JOB_RUNNER_MODULE", "run_job_process"]

EndState = Callable[[Session, FineTuningJob], None]


def runner_hostname() -> str:
    """This process's claim on a job: the worker's nodename (from the env) or host:pid standalone."""
    return os.environ.get(HOSTNAME_ENV) or f"runner@{socket.gethostname()}:{os.getpid()}"


def _finish(url: str, job_id: str, hostname: str, end: EndState) -> bool:
    """Write the end state (``end``, a :mod:`store.jobs` transition) if the job is still ours; False when
    it was taken away meanwhile."""
    with session_scope(url) as s:
        job = jobs.lock_job(s, job_id)
        if job is None or job.status != JobStatus.running.value or job.worker_hostname != hostname:
            return False
        job.heartbeat_at = utcnow()
        end(s, job)
    return True


def _failed(code: str, message: str, *, param: str | None = None, event: str) -> EndState:
    return lambda s, job: jobs.fail(s, job, code, message, param=param, event=event)


def _succeeded(result: Any, results_dir: Path) -> EndState:
    """The job's outputs, its metrics CSV as a ``fine-tune-results`` file listed in ``result_files`` (in
    the same transaction; a file that cannot be written is logged and left out: the model is what the
    job was for), then succeeded."""

    def end(s: Session, job: FineTuningJob) -> None:
        job.fine_tuned_model = result.final_model_dir
        job.trained_tokens = result.trained_tokens
        job.global_step = result.steps
        try:
            add_results_file(s, job, results_dir)
        except OSError:
            log.exception("job %s: could not write its results file", job.id)
        jobs.succeed(s, job, f"Job succeeded: {result.steps} steps, final model at {result.final_model_dir}")

    return end


def _claim_standalone(s: Session, job: FineTuningJob, hostname: str, settings: Settings) -> bool:
    """Whether this process runs the job: claimed for it by its worker, or (run by hand) a waiting job
    claimed here the way the worker does."""
    if job.status == JobStatus.running.value:
        return job.worker_hostname == hostname
    return jobs.claim(s, job, hostname, max_attempts=settings.max_job_attempts,
                      heartbeat_timeout_seconds=settings.heartbeat_timeout_seconds) is jobs.Claim.claimed


def run_job_process(job_id: str, *, settings: Settings | None = None) -> int:
    """Run the job to an end state; see the module docstring for the exit codes."""
    from trainer.spec import spec_from_job

    settings = settings or get_settings()
    url = settings.resolved_database_url
    hostname = runner_hostname()
    with session_scope(url) as s:
        job = jobs.lock_job(s, job_id)
        if job is None:
            log.error("job %s not found", job_id)
            return EXIT_DONE
        if JobStatus(job.status).terminal:
            return EXIT_DONE
        if not _claim_standalone(s, job, hostname, settings):
            log.warning("job %s is %s on %s: not ours", job_id, job.status, job.worker_hostname)
            return EXIT_LOST
        training = s.get(File, job.training_file_id)
        validation = s.get(File, job.validation_file_id) if job.validation_file_id else None
        output_dir = Path(job.output_dir) if job.output_dir else settings.resolved_jobs_dir / job.id
        job.output_dir = str(output_dir)
        fields: dict[str, Any] = dict(
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
        _finish(url, job_id, hostname, _failed("invalid_job", str(e), event=f"Invalid job: {e}"))
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
    spec: Any, job_id: str, url: str, hostname: str, monitor: JobMonitor, paths: dict[str, str], files_dir: Path
) -> int:
    from trainer.data import DatasetValidationError
    from trainer.loop import run_training
    from trainer.models import UnknownModelError
    from trainer.worker.telemetry import track_job

    try:
        try:
            # Prometheus telemetry of this run sees every event after the database.
            with track_job(job_id, base_model=spec.model, mode=spec.engine.mode) as tj:
                result = run_training(spec, on_event=tj.wrap(DBReporter(job_id, url, hostname)),
                                      should_cancel=monitor.should_stop)
        finally:
            monitor.stop()
    except DatasetValidationError as e:
        param = paths.get(str(Path(e.path)), "training_file")
        _finish(url, job_id, hostname,
                _failed(f"invalid_{param}", str(e), param=param, event=f"Invalid {param}: {e}"))
        return EXIT_DONE
    except UnknownModelError as e:
        _finish(url, job_id, hostname, _failed("model_not_found", str(e), param="model", event=str(e)))
        return EXIT_DONE
    except Exception as e:
        log.exception("job %s failed", job_id)
        msg = f"{type(e).__name__}: {e}"
        if not monitor.lost.is_set():
            _finish(url, job_id, hostname, _failed("training_error", msg, event=f"Training failed: {msg}"))
        return EXIT_LOST if monitor.lost.is_set() else EXIT_DONE
    if monitor.lost.is_set():
        return EXIT_LOST
    if result.cancelled:
        if monitor.cancel.is_set():
            _finish(url, job_id, hostname,
                    lambda s, job: jobs.cancel(s, job, f"Job cancelled at step {result.steps}"))
            return EXIT_DONE
        return EXIT_PREEMPTED
    return EXIT_DONE if _finish(url, job_id, hostname, _succeeded(result, files_dir)) else EXIT_LOST


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {JOB_RUNNER_MODULE}", description="Run one job from the database.")
    parser.add_argument("job_id")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_job_process(args.job_id)


if __name__ == "__main__":
    sys.exit(main())

"""Run one job from the database: ``python -m worker.job.runner JOB_ID``.

The worker task spawns this as a subprocess (a killable PID, CUDA initialised only here). It loads the
job and file rows, builds the JobSpec of its request (:func:`trainer.spec.spec_of_request`), takes its
resolution for this worker (a new one when the worker's machine differs from the one it was resolved for,
or the checkpoint it resumes pins another engine mode: recorded on the job; a refusal when it does not fit
here, :mod:`worker.capacity.fit`), makes the job's checkpoint
rows match its output directory, runs :func:`trainer.run.loop.run_training` with a
:class:`~worker.job.reporter.DBReporter` (events -> rows, written in order by a
:class:`~worker.job.writer.ReportWriter` that waits out database outages; a job's tracking
integrations get the same events, :func:`worker.tracking.job.open_tracking`) inside
:func:`~worker.metrics.telemetry.track_job` (Prometheus), while a
:class:`~worker.job.monitor.JobMonitor` beats the heartbeat and polls for a cancel or a pause, and writes
the end state through :mod:`store.jobs`: succeeded (``fine_tuned_model`` = the final model's ``ft:`` id,
registered by :mod:`store.model_ids`, ``trained_tokens``, the metrics CSV as a result file), cancelled,
paused (stopped at a step as a cancel is, its checkpoint kept: store.jobs.request_pause), or failed with ``error = {code,
message, param}``; data errors name the file param; a job stopped by its team's GPU-hour or storage
quota fails ``quota_exceeded`` (:mod:`worker.job.quota_watch`). Every database write is retried across
connection drops for up to ``Settings.job_db_outage_seconds``; a message a user sees never carries
SQL (:func:`worker.errors.public_message`).

Exit codes: :mod:`worker.job.exits`.

A job on N > 1 ranks (``resources.gpus``) runs as N of these processes, started by the worker under torch's
elastic agent (:class:`trainer.run.launch.NodeRanks`) with the ``env://`` variables (WORLD_SIZE > 1): each joins the group
(:func:`trainer.run.distributed.init_from_env`) first. Rank 0 is the runner described above and, once it
knows whether the job runs, hands the JobSpec (or None) to the others (:func:`run_peer_rank`); they
never touch the database, train with ``dist`` and report only their step metrics to Prometheus.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from contract.job import Resolution
from store import jobs, model_ids
from store.db import session_scope
from store.orm import File, FineTuningJob, JobStatus, utcnow
from store.results import add_results_file
from store.settings import Settings, get_settings
from trainer.model.catalog import BUILTIN_MODELS
from worker.capacity import fit
from worker.capacity.measure import to_machine
from worker.errors import public_message, scrub
from worker.job.exits import (
    EXIT_DB_UNAVAILABLE,
    EXIT_DISK_FULL,
    EXIT_DONE,
    EXIT_LOST,
    EXIT_PEER_LOST,
    EXIT_PREEMPTED,
    EXIT_WRONG_RANKS,
)
from worker.job.monitor import JobMonitor, exit_lost
from worker.job.quota_watch import QuotaReached, QuotaWatch
from worker.job.ranks import Announce, peer_lost, run_peer_rank
from worker.job.reporter import DBReporter
from worker.job.writer import SPOOL_NAME, ReportWriter, Write, event_row
from worker.retry import DatabaseUnavailable, retry_db
from worker.tracking.base import Tracking
from worker.tracking.job import open_tracking

if TYPE_CHECKING:
    from trainer.plan.gpus import Machine
    from trainer.spec import JobSpec

log = logging.getLogger("zenflow.job_runner")

HOSTNAME_ENV = "ZENFLOW_WORKER_HOSTNAME"
#: What the worker task runs with ``python -m``.
JOB_RUNNER_MODULE = "worker.job.runner"
#: After an interruption, how long the unwritten reports may still try the database before they are
#: saved to the spool file.
_LAST_TRY_SECONDS = 10.0

__all__ = ["HOSTNAME_ENV", "JOB_RUNNER_MODULE", "run_job_process", "run_rank"]

EndState = Callable[[Session, FineTuningJob], None]


def runner_hostname() -> str:
    """This process's claim on a job: the worker's nodename (from the env) or host:pid standalone."""
    return os.environ.get(HOSTNAME_ENV) or f"runner@{socket.gethostname()}:{os.getpid()}"


def _finish(url: str, job_id: str, hostname: str, end: EndState, window: float) -> int:
    """Write the end state (``end``, a :mod:`store.jobs` transition) if the job is still ours, retrying
    across connection drops; the exit code: done, lost (taken away meanwhile) or database unavailable."""

    def once() -> bool:
        with session_scope(url) as s:
            job = jobs.lock_job(s, job_id)
            if job is None or job.status != JobStatus.running.value or job.worker_hostname != hostname:
                return False
            job.heartbeat_at = utcnow()
            end(s, job)
        return True

    try:
        return EXIT_DONE if retry_db(once, window=window, what=f"job {job_id}: end state") else EXIT_LOST
    except DatabaseUnavailable as e:
        log.error("job %s: could not write its end state: %s", job_id, e)
        return EXIT_DB_UNAVAILABLE


def _failed(
    code: str, message: str, *, param: str | None = None, event: str, error: Exception | None = None
) -> EndState:
    """Fail the job; its one error event carries ``error``'s type (and a data file's line errors)."""
    data: dict[str, Any] | None = None
    if error is not None:
        data = {"error_type": type(error).__name__}
        line_errors = getattr(error, "errors", None)  # DatasetValidationError's
        if isinstance(line_errors, list):
            data["errors"] = [dict(x) for x in line_errors[:20]]
    return lambda s, job: jobs.fail(s, job, code, message, param=param, event=event, data=data)


def _succeeded(result: Any, results_dir: Path) -> EndState:
    """The job's outputs, its metrics CSV as a ``fine-tune-results`` file listed in ``result_files`` (in
    the same transaction; a file that cannot be written is logged and left out: the model is what the
    job was for), then succeeded."""

    def end(s: Session, job: FineTuningJob) -> None:
        model_ids.register_final(s, job, result.final_model_dir)  # job.fine_tuned_model = its ft: id
        job.trained_tokens = result.trained_tokens
        job.global_step = result.steps
        try:
            add_results_file(s, job, results_dir)
        except OSError:
            log.exception("job %s: could not write its results file", job.id)
        jobs.succeed(s, job, f"Job succeeded: {result.steps} steps, fine-tuned model {job.fine_tuned_model}")

    return end


def _claim_standalone(s: Session, job: FineTuningJob, hostname: str, settings: Settings) -> bool:
    """Whether this process runs the job: claimed for it by its worker, or (run by hand) a waiting job
    claimed here the way the worker does."""
    if job.status == JobStatus.running.value:
        return job.worker_hostname == hostname
    return (
        jobs.claim(
            s,
            job,
            hostname,
            max_attempts=settings.max_job_attempts,
            heartbeat_timeout_seconds=settings.heartbeat_timeout_seconds,
        )
        is jobs.Claim.claimed
    )


@dataclass(frozen=True)
class _Loaded:
    """What the runner reads of the job: its spec's parts, its current resolution, the data files' params."""

    spec: dict[str, Any]
    resolution: Resolution | None
    paths: dict[str, str]


def _load(url: str, job_id: str, hostname: str, settings: Settings, *, world: int = 1) -> int | _Loaded:
    """The job's spec parts and resolution, or the exit code when the job is not to run here."""
    with session_scope(url) as s:
        job = jobs.lock_job(s, job_id)
        if job is None:
            log.error("job %s not found", job_id)
            return EXIT_DONE
        if JobStatus(job.status).terminal:
            return EXIT_DONE
        if job.world_size != world:  # never run a job on other ranks than it asks for (all nodes')
            log.error("job %s asks for %d rank(s); this group has %d", job_id, job.world_size, world)
            return EXIT_WRONG_RANKS
        if not _claim_standalone(s, job, hostname, settings):
            log.warning("job %s is %s on %s: not ours", job_id, job.status, job.worker_hostname)
            return EXIT_LOST
        try:  # an ft: id or a model-root name -> its folder (the team's own, still there)
            model = model_ids.spec_model(s, job.team_id, job.model, settings.model_roots, BUILTIN_MODELS)
        except model_ids.ModelLookupError as e:
            jobs.fail(s, job, "model_not_found", str(e), param="model")
            return EXIT_DONE
        training = s.get(File, job.training_file_id)
        validation = s.get(File, job.validation_file_id) if job.validation_file_id else None
        output_dir = Path(job.output_dir) if job.output_dir else settings.resolved_jobs_dir / job.id
        job.output_dir = str(output_dir)
        request = job.request
        hp = request.hyperparameters.model_copy(update={"seed": job.seed})  # the seed the create drew
        files = {
            "training_file": training.storage_path if training else "",
            "validation_file": validation.storage_path if validation else None,
        }
        spec: dict[str, Any] = dict(
            request=request.model_copy(update={"hyperparameters": hp}),
            model=model,
            model_name=job.model,  # the API's id: the adapter and model card name it, not the folder
            **files,
            output_dir=output_dir,
            engine_tuning=settings.engine_tuning,
        )
        resolution = job.resolution
    paths = {str(Path(p)): name for name, p in files.items() if p}
    return _Loaded(spec, resolution, paths)


def run_job_process(job_id: str, *, settings: Settings | None = None, dist: Any = None) -> int:
    """Run the job to an end state; see the module docstring for the exit codes. ``dist``: this is rank
    0 of the job's :class:`trainer.run.distributed.DistContext` (None: the only process)."""
    from trainer.spec import spec_of_request

    settings = settings or get_settings()
    url, window = settings.resolved_database_url, settings.job_db_outage_seconds
    hostname = runner_hostname()
    world = dist.world_size if dist is not None else 1
    announce = Announce(dist)
    try:
        try:
            loaded = retry_db(
                lambda: _load(url, job_id, hostname, settings, world=world),
                window=window,
                what=f"job {job_id}: start",
            )
        except DatabaseUnavailable as e:
            log.error("job %s: cannot start: %s", job_id, e)
            return EXIT_DB_UNAVAILABLE
        if isinstance(loaded, int):
            return loaded
        try:
            spec = spec_of_request(**loaded.spec)
        except Exception as e:
            msg = scrub(str(e))
            announce(None)
            return _finish(
                url, job_id, hostname, _failed("invalid_job", msg, event=f"Invalid job: {msg}"), window
            )
        return _supervised(spec, loaded, job_id, url, hostname, settings, dist, announce)
    finally:
        announce(None)  # whatever stopped the job before it ran: the other ranks exit


def _supervised(
    spec: JobSpec,
    loaded: _Loaded,
    job_id: str,
    url: str,
    hostname: str,
    settings: Settings,
    dist: Any,
    announce: Announce,
) -> int:
    """The claimed job with its monitor and writer running: its resolution for this worker, then the run."""
    window = settings.job_db_outage_seconds
    interrupted = threading.Event()  # the database away for longer than the window
    monitor = JobMonitor(
        job_id,
        url,
        hostname,
        settings.heartbeat_interval_seconds,
        outage_seconds=window,
        interrupted=interrupted,
        quota=QuotaWatch(url, job_id, settings),
    )

    def on_lost() -> None:
        monitor.lost.set()
        exit_lost(job_id)

    writer = ReportWriter(
        url,
        job_id,
        hostname,
        outage_seconds=window,
        max_items=settings.job_db_buffer_items,
        on_lost=on_lost,
        interrupted=interrupted,
    )
    writer.start()
    monitor.start()
    previous = signal.signal(signal.SIGTERM, lambda *_: monitor.preempted.set())
    try:
        # Rather than run out of memory halfway: the job's resolution for this worker's machine (a new
        # one, planned, when the worker differs from the one it was resolved for). After the heartbeat
        # has started: planning (and measuring a capacity the worker has not registered yet) can take
        # seconds, longer than a short heartbeat timeout.
        decided = _resolution_here(spec, loaded, url, hostname, writer, window)
        if isinstance(decided, fit.Refusal):
            monitor.stop()
            announce(None)
            return _finish(
                url,
                job_id,
                hostname,
                _failed(fit.CODE, decided.message, param=decided.param, event=decided.message),
                window,
            )
        assert spec.output_dir is not None
        if (short := _space_short(spec.output_dir, writer, window)) is not None:
            monitor.stop()
            announce(None)
            return short
        if monitor.quota is not None and monitor.quota.reached is not None:  # reached while it started
            monitor.stop()
            announce(None)
            return _finish(url, job_id, hostname, monitor.quota.end_state(), window)
        announce((spec, decided[0]))
        run = _Run(spec, job_id, url, hostname, monitor, writer, loaded.paths, settings, dist)
        return run.run(*decided)
    finally:
        signal.signal(signal.SIGTERM, previous)
        monitor.stop()
        writer.close()


def _resolution_here(
    spec: JobSpec, loaded: _Loaded, url: str, hostname: str, writer: ReportWriter, window: float
) -> tuple[Resolution | None, Machine] | fit.Refusal:
    """The job's resolution on this worker's machine and the machine: the job's own while it holds (the
    machine it was planned for, the checkpoint it resumes), else a new one, recorded on the job; the
    refusal when the job does not fit here. A job not resolved yet (created before resolutions were
    recorded) is resolved by its run, once its data is counted."""
    from trainer.resolve import Counts, for_run
    from trainer.run.checkpoint import checkpoint_pins
    from trainer.run.setup import plan_event

    capacity = fit.worker_capacity(url, hostname, window=window)
    machine = to_machine(capacity)
    given = loaded.resolution
    if given is None:
        return None, machine
    counts = Counts(given.num_examples, given.num_tokens)
    assert spec.output_dir is not None
    resolution, plan, new = for_run(spec, given, machine, counts, checkpoint_pins(spec.output_dir))
    if not new:
        return resolution, machine
    if plan is not None and not plan.fits:
        refused = fit.refusal_here(spec, hostname, capacity, counts)
        if refused is not None:
            return refused
    changes = resolution.job.changes(given.job)
    shown = "; ".join(f"{k} {v['from']} -> {v['to']}" for k, v in changes.items())
    events = [plan_event(plan)] if plan is not None else []
    text = f"Settings decided again on worker {hostname}: {resolution.reason}" + (
        f" ({shown})" if shown else ""
    )
    writer.put(
        Write(
            resolution=resolution.model_dump(mode="json"),
            events=[
                *(event_row(e.message, level=e.level, data=e.data) for e in events),
                event_row(text, data={"changes": changes}),
            ],
        )
    )
    return resolution, machine


def _space_short(output_dir: Path, writer: ReportWriter, window: float) -> int | None:
    """A job resumed onto a disk still without room for one more checkpoint (the newest one's size,
    trainer.run.checkpoint.space_short) would train to it and stop again: exit 74 before anything is
    loaded, with the full disk's warning (worker.requeue re-queues it to wait off the GPU)."""
    from trainer.run.checkpoint import space_short

    if (message := space_short(Path(output_dir))) is None:
        return None
    log.error("%s", message)
    data = {"error_type": "DiskFullError", "errors": [], "disk_full": message}
    writer.put(Write(events=[event_row(message, level="warning", data=data)]))
    writer.flush(window)
    return EXIT_DISK_FULL


class _Run:
    """One run of the job in this process, from the reconciliation of its checkpoints to its exit code."""

    def __init__(
        self,
        spec: Any,
        job_id: str,
        url: str,
        hostname: str,
        monitor: JobMonitor,
        writer: ReportWriter,
        paths: dict[str, str],
        settings: Settings,
        dist: Any = None,
    ) -> None:
        self.spec, self.job_id, self.url, self.hostname, self.dist = spec, job_id, url, hostname, dist
        self.monitor, self.writer, self.paths = monitor, writer, paths
        self.window, self.files_dir = settings.job_db_outage_seconds, settings.resolved_files_dir
        self.settings = settings
        self.out = Path(spec.output_dir)
        self.spool = self.out / SPOOL_NAME

    def run(self, resolution: Resolution | None, machine: Machine) -> int:
        """The run with its tracking (worker.tracking), closed before the end state on success."""
        tracking = open_tracking(self.url, self.job_id, self.settings, self.writer, self.out)
        try:
            return self._train(tracking, resolution, machine)
        finally:
            tracking.close(succeeded=False)  # a no-op once closed

    def _train(self, tracking: Tracking, resolution: Resolution | None, machine: Machine) -> int:
        """The run, then what it ended in: an end state written, or an exit code for the worker."""
        on_event = self._reporting(tracking)
        try:
            result = self._run_training(on_event, resolution, machine)
        except Exception as e:
            outcome = self._failure(e)
        else:
            outcome = self._outcome(result)
        if isinstance(outcome, int):
            return outcome
        end, succeeded = outcome
        tracking.close(succeeded=succeeded)  # its warnings before the end state
        if self.monitor.lost.is_set():
            return EXIT_LOST
        if not self._drain():
            if self.writer.fatal is None:
                return EXIT_DB_UNAVAILABLE
            msg = public_message(self.writer.fatal)
            end = _failed("training_error", msg, event=f"Training failed: {msg}")
        return _finish(self.url, self.job_id, self.hostname, end, self.window)

    def _reporting(self, tracking: Tracking) -> Callable[[Any], None]:
        """The run's event callback (database, quota guard, tracking), after a previous run's unwritten
        reports and the checkpoint rows are put right."""
        from trainer.run.checkpoint import prune_checkpoints

        reporter = DBReporter(self.writer)
        on_event = self.monitor.quota.guard(reporter) if self.monitor.quota is not None else reporter
        if n := self.writer.load_spool(self.spool):
            log.info("job %s: writing %d reports a previous run could not", self.job_id, n)
        prune_checkpoints(self.out, self.spec.keep_checkpoints)
        reporter.sync_checkpoints(self.out)
        return tracking.wrap(on_event)

    def _run_training(
        self, on_event: Callable[[Any], None], resolution: Resolution | None, machine: Machine
    ) -> Any:
        """run_training under the job's Prometheus telemetry (which sees every event after the database)."""
        from store.serving_endpoint import get_serving_endpoint
        from trainer.run.loop import run_training
        from worker.grading import job_grading
        from worker.metrics.telemetry import track_job

        spec, monitor = self.spec, self.monitor
        mode = resolution.job.engine.mode if resolution is not None else "unknown"
        try:
            with (
                job_grading(self.settings, get_serving_endpoint(), spec.method) as grading,
                track_job(self.job_id, base_model=spec.model, mode=mode, paused=monitor.paused) as tj,
            ):
                return run_training(
                    spec,
                    on_event=tj.wrap(on_event),
                    should_cancel=monitor.should_stop,
                    dist=self.dist,
                    resolution=resolution,
                    machine=machine,
                    grading=grading,
                )
        finally:
            monitor.stop()

    def _failure(self, e: Exception) -> tuple[EndState, bool] | int:
        """The end state of a run that raised ``e`` (its input named), or the exit code that leaves the
        job to the worker (a full disk, another rank lost)."""
        from trainer.data.dataset import DatasetValidationError
        from trainer.model.catalog import UnknownModelError
        from trainer.model.folder_check import ModelFolderError
        from trainer.run.checkpoint import DiskFullError, is_out_of_space

        if isinstance(e, DatasetValidationError):
            param = self.paths.get(str(Path(e.path)), "training_file")
            return _failed(
                f"invalid_{param}", str(e), param=param, event=f"Invalid {param}: {e}", error=e
            ), False
        if isinstance(e, UnknownModelError):
            return _failed("model_not_found", str(e), param="model", event=str(e), error=e), False
        if isinstance(e, ModelFolderError):  # the folder changed since the job was created
            msg = f"the model cannot be fine-tuned: {e.problem}"
            return _failed(
                "invalid_model", msg, param="model", event=f"Invalid model: {e.problem}", error=e
            ), False
        if isinstance(e, QuotaReached):  # the storage quota at the run's last checkpoint
            return e.watch.end_state(), False
        if isinstance(e, DiskFullError) or is_out_of_space(e):
            log.error("job %s: %s", self.job_id, e)
            self._drain()
            return EXIT_DISK_FULL
        if self.dist is not None and peer_lost(e):
            log.error("job %s: another rank failed (%s); leaving the job to the worker", self.job_id, e)
            self._drain()
            return EXIT_PEER_LOST
        log.exception("job %s failed", self.job_id)
        msg = public_message(e)
        return _failed("training_error", msg, event=f"Training failed: {msg}", error=e), False

    def _outcome(self, result: Any) -> tuple[EndState, bool] | int:
        """The end state of a run that returned (and whether it succeeded), or the exit code of one that
        stopped for the worker's sake (preempted, the database away for too long)."""
        monitor = self.monitor
        if not result.cancelled:
            return _succeeded(result, self.files_dir), True
        if monitor.cancel.is_set():
            return (lambda s, job: jobs.cancel(s, job, f"Job cancelled at step {result.steps}")), False
        if monitor.paused():  # a user's pause: before a quota's stop
            return (lambda s, job: jobs.pause(s, job, f"Job paused at step {result.steps}")), False
        if monitor.quota is not None and monitor.quota.reached is not None:
            return monitor.quota.end_state(), False
        self._drain()
        return EXIT_PREEMPTED if monitor.preempted.is_set() else EXIT_DB_UNAVAILABLE

    def _drain(self) -> bool:
        """Wait for the reports to be written (within the outage window; after an interruption, a last
        short try); what cannot be is saved to the spool file for the next run. True when all went."""
        w = self.writer
        if w.flush() or w.fatal is not None:
            return w.fatal is None
        w.flush(min(_LAST_TRY_SECONDS, self.window), past_interruption=True)
        left = w.close()
        if left:
            saved = w.save_spool(self.spool, left)
            log.error(
                "job %s: database unavailable; %d reports %s",
                self.job_id,
                len(left),
                f"saved to {self.spool} for the next run" if saved else "lost",
            )
        return not left


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1


def run_rank(job_id: str) -> int:
    """One rank of a job's group (WORLD_SIZE > 1): join the group, run as rank 0 or a peer, leave."""
    from trainer.run.distributed import init_from_env, shutdown

    try:
        dist = init_from_env()
    except Exception:
        log.exception("job %s: cannot join its process group", job_id)
        return 1
    try:
        if dist is None or dist.rank == 0:
            return run_job_process(job_id, dist=dist)
        return run_peer_rank(job_id, dist)
    finally:
        shutdown(dist)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {JOB_RUNNER_MODULE}", description="Run one job from the database."
    )
    parser.add_argument("job_id")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if _world_size() > 1:
        return run_rank(args.job_id)
    return run_job_process(args.job_id)


if __name__ == "__main__":
    sys.exit(main())

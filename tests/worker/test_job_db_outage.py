"""The job process against a PostgreSQL that drops its connections and goes away (issue 16, items 1 and 7).

Each test works on a private database of the local server: backends are killed with
``pg_terminate_backend`` and, for an outage, the database refuses new connections
(``ALLOW_CONNECTIONS false``) while the server keeps running for everyone else. The job runner runs as
its own process (``python -m worker.job.runner``, as the worker spawns it) or under a real
Celery worker, on tiny-llama and short intervals through the settings.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import make_url

from store.db import get_engine, session_scope
from store.orm import FineTuningJob, JobCheckpoint, JobEvent, JobStepMetric
from store.settings import Settings
from tests.support import database_with_schema, pg_admin
from tests.worker.test_worker import Workers, make_job, runner_pids, sums_file
from tests.worker.test_worker import get_job as job_row

pytestmark = [pytest.mark.services, pytest.mark.usefixtures("torch_single_thread"), pytest.mark.timeout(300)]

HOSTNAME = "runner@outage-test"
STEP_EVENT = re.compile(r"^Step (\d+)/\d+: training loss=")


@pytest.fixture
def db_url() -> Iterator[str]:
    """A private database (store.orm tables) this test may cut off."""
    with database_with_schema("zf_outage") as url:
        yield url


def _dbname(url: str) -> str:
    return str(make_url(url).database)


def terminate_backends(url: str) -> int:
    """Kill every connection to the test's database; how many were killed."""
    rows = pg_admin(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d "
        "AND pid <> pg_backend_pid()",
        d=_dbname(url),
    )
    return sum(1 for (ok,) in rows if ok)  # type: ignore[misc]


@contextlib.contextmanager
def database_away(url: str) -> Iterator[None]:
    """The database refuses connections and loses the ones it had, until the block ends."""
    pg_admin(f'ALTER DATABASE "{_dbname(url)}" ALLOW_CONNECTIONS false')
    try:
        terminate_backends(url)
        yield
    finally:
        pg_admin(f'ALTER DATABASE "{_dbname(url)}" ALLOW_CONNECTIONS true')


class Terminator(threading.Thread):
    """Keeps the database away for ``outage`` seconds (shorter than the job's outage window) at once and
    then every ``outage_every`` seconds, and kills its backends every ``every`` seconds in between,
    until stopped."""

    def __init__(
        self, url: str, *, every: float = 1.0, outage_every: float = 4.0, outage: float = 1.5
    ) -> None:
        super().__init__(daemon=True)
        self.url, self.every, self.outage_every, self.outage = url, every, outage_every, outage
        self.killed = self.outages = 0
        self._halt = threading.Event()

    def run(self) -> None:
        last_outage = 0.0
        while not self._halt.is_set():
            if time.monotonic() - last_outage >= self.outage_every:
                with database_away(self.url):
                    self.outages += 1
                    self._halt.wait(self.outage)
                last_outage = time.monotonic()
            elif not self._halt.wait(self.every):
                self.killed += terminate_backends(self.url)

    def stop(self) -> None:
        self._halt.set()
        self.join(30)
        assert not self.is_alive()


def runner_env(url: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZENFLOW_")}
    env.update(
        ZENFLOW_DATABASE_URL=url,
        ZENFLOW_DATA_DIR=str(tmp_path / "var"),
        ZENFLOW_WORKER_HOSTNAME=HOSTNAME,
        ZENFLOW_HEARTBEAT_INTERVAL_SECONDS="0.5",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


def start_runner(url: str, job_id: str, tmp_path: Path, **extra: str) -> tuple[subprocess.Popen[bytes], Path]:
    from worker.job.runner import JOB_RUNNER_MODULE

    log = tmp_path / f"runner-{time.monotonic_ns()}.log"
    with log.open("wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", JOB_RUNNER_MODULE, job_id],
            env=runner_env(url, tmp_path, **extra),
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    return proc, log


def wait_for(cond: Callable[[], Any], timeout: float, what: str, log: Path | None = None) -> Any:
    """``cond()`` once truthy; database errors while the test cuts the database off count as not yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if v := cond():
                return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{log.read_text()[-5000:] if log else ''}")


def events(url: str, job_id: str) -> list[JobEvent]:
    with session_scope(url) as s:
        return list(s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)))


def metric_steps(url: str, job_id: str) -> list[int]:
    with session_scope(url) as s:
        return list(
            s.scalars(
                select(JobStepMetric.step).where(JobStepMetric.job_id == job_id).order_by(JobStepMetric.step)
            )
        )


def checkpoint_rows(url: str, job_id: str) -> dict[int, str]:
    with session_scope(url) as s:
        return {
            r.step_number: r.path
            for r in s.execute(
                select(JobCheckpoint.step_number, JobCheckpoint.path).where(JobCheckpoint.job_id == job_id)
            )
        }


def step_event_counts(evs: list[JobEvent]) -> Counter[int]:
    return Counter(int(m.group(1)) for e in evs if (m := STEP_EVENT.match(e.message)))


def assert_complete(url: str, job_id: str) -> FineTuningJob:
    """The job succeeded with a metrics row and exactly one "Step N" event for each step (in step order),
    its checkpoint rows naming exactly the complete checkpoints on disk, and no SQL in any message."""
    from trainer.run.checkpoint import list_checkpoints

    job = job_row(url, job_id)
    evs = events(url, job_id)
    assert job.status == "succeeded", (job.status, job.error, [e.message for e in evs][-10:])
    assert job.total_steps and job.global_step == job.total_steps
    steps = list(range(1, job.total_steps + 1))
    assert metric_steps(url, job_id) == steps
    counts = step_event_counts(evs)
    assert sorted(counts) == steps and set(counts.values()) == {1}, {
        k: v for k, v in counts.items() if v != 1
    }
    on_disk = {c.step: str(c.path) for c in list_checkpoints(Path(str(job.output_dir)))}
    assert on_disk and checkpoint_rows(url, job_id) == on_disk
    assert job.last_checkpoint_path == on_disk[max(on_disk)]
    in_order = [int(m.group(1)) for e in evs if (m := STEP_EVENT.match(e.message))]
    assert in_order == steps  # written in the order trained, whatever the outages
    for e in evs:
        assert "[SQL" not in e.message and "UPDATE fine_tuning_jobs" not in e.message, e.message
    return job


HP = {"batch_size": 4, "max_seq_length": 64, "n_epochs": 100, "warmup": 0, "eval_every": None}


# --- the process under fire ---------------------------------------------------------------------


def test_job_survives_dropped_connections_and_short_outages(db_url: str, tmp_path: Path) -> None:
    """Backends killed every half second and the database away for 1 s every 2.5 s: the job trains on,
    writes everything in order once it can, and succeeds (the issue's repro failed at step 346)."""
    job_id = make_job(
        db_url,
        sums_file(tmp_path / "d.jsonl"),
        hyperparameters={**HP, "max_steps": 600, "checkpoint_every": 50},
    )
    proc, log = start_runner(db_url, job_id, tmp_path, ZENFLOW_JOB_DB_OUTAGE_SECONDS="30")
    terminator = Terminator(db_url, every=0.5, outage_every=2.5, outage=1.0)
    try:
        wait_for(lambda: job_row(db_url, job_id).global_step >= 1, 120, "training to start", log)
        terminator.start()
        rc = proc.wait(240)
    finally:
        if terminator.is_alive():
            terminator.stop()
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert rc == 0, out[-5000:]
    assert terminator.outages >= 1 and terminator.killed >= 1, (terminator.outages, terminator.killed)
    assert "database unavailable" in out and "database back after" in out, out[-5000:]  # it did see them
    job = assert_complete(db_url, job_id)
    assert job.attempts == 1 and job.error is None


WINDOW_S = 3.0  # the job's outage window in the test below


def steps_outlasting(url: str, workers: Workers, data: Path, queue: str, *, seconds: float) -> int:
    """A step count whose training takes about ``seconds`` on this box as loaded now, measured by a short
    job of the same shape on the same worker (its median compute time per step), on top of the first
    checkpoint's 60 steps. Steps run faster while the database is away (nothing to write: here 7 ms
    against 11 ms measured), so ``seconds`` leaves a margin of a few windows."""
    probe = make_job(
        url, data, queue=queue, hyperparameters={**HP, "max_steps": 80, "checkpoint_every": 1000}
    )
    workers.enqueue(probe)
    wait_for(lambda: job_row(url, probe).status == "succeeded", 120, "the probe job", workers.log)
    with session_scope(url) as s:
        times = sorted(
            s.scalars(
                select(JobStepMetric.step_seconds).where(
                    JobStepMetric.job_id == probe, JobStepMetric.step > 10
                )
            )
        )
    per_step = times[len(times) // 2]
    assert per_step > 0, times
    return 60 + min(15_000, max(940, int(seconds / per_step)))  # the job below has at most 16,000


@pytest.mark.slow
def test_outage_past_the_window_interrupts_requeues_and_resumes(
    db_url: str, tmp_path: Path, redis_broker_url: str, unique_queue: str
) -> None:
    """The database away for longer than the job's window (3 s here): the run checkpoints and exits as
    interrupted, the worker re-queues it with the attempt counted, the next attempt resumes from the
    checkpoint and writes what the first could not, and the job succeeds, never failed."""
    settings = Settings(data_dir=tmp_path / "var", database_url=db_url)
    workers = Workers(settings, redis_broker_url, unique_queue, tmp_path)
    try:
        worker = workers.start(
            "w1",
            ZENFLOW_JOB_DB_OUTAGE_SECONDS=f"{WINDOW_S:g}",
            ZENFLOW_HEARTBEAT_INTERVAL_SECONDS="0.5",
            ZENFLOW_HEARTBEAT_TIMEOUT_SECONDS="120",
        )
        data = sums_file(tmp_path / "d.jsonl")
        total = steps_outlasting(db_url, workers, data, unique_queue, seconds=5 * WINDOW_S)
        job_id = make_job(
            db_url,
            data,
            queue=unique_queue,
            # max_steps decides (epochs of 16 steps: 1000 of them would be 16,000 steps)
            hyperparameters={**HP, "n_epochs": 1000, "max_steps": total, "checkpoint_every": 50},
        )
        workers.enqueue(job_id)
        wait_for(
            lambda: job_row(db_url, job_id).global_step >= 60, 120, "training past a checkpoint", workers.log
        )
        runner = wait_for(lambda: runner_pids(worker.pid), 10, "the runner process")[0]
        with database_away(db_url):
            # the run notices, waits out its 3 s window, checkpoints, and exits
            wait_for(
                lambda: (
                    not Path(f"/proc/{runner}").exists()
                    or b") Z" in Path(f"/proc/{runner}/stat").read_bytes()
                ),
                60,
                "the runner to stop",
                workers.log,
            )
        wait_for(
            lambda: job_row(db_url, job_id).status in ("succeeded", "failed"),
            180,
            "the job to finish",
            workers.log,
        )
    finally:
        workers.stop()
    job = assert_complete(db_url, job_id)
    msgs = [e.message for e in events(db_url, job_id)]
    assert job.attempts == 2 and job.error is None, (job.attempts, job.error)
    interrupted = [
        m
        for m in msgs
        if m.startswith(
            "Training interrupted: the database was unreachable for more "
            f"than {WINDOW_S:g} s; re-queued to resume from step "
        )
    ]
    assert len(interrupted) == 1, msgs
    step = int(interrupted[0].rsplit(" ", 1)[1])
    assert step < total, f"the run reached its last step ({total}) inside the outage: calibrate longer"
    assert f"Training resumed at step {step}: {total} steps" in " | ".join(msgs)
    assert "Attempt 2/3 started on w1@test, resuming from step" in " | ".join(msgs)
    assert not (
        Path(str(job.output_dir)) / ".zenflow-unwritten-reports.jsonl"
    ).exists()  # written, then removed


@pytest.mark.slow
def test_resumed_run_writes_one_step_event_per_step_and_reconciles_checkpoints(
    db_url: str, tmp_path: Path
) -> None:
    """Killed between two checkpoints, resumed by a second process: the replayed steps get no second
    "Step N" event (item 7), a checkpoint on disk without its row is registered, and a row without its
    directory goes."""
    job_id = make_job(
        db_url,
        sums_file(tmp_path / "d.jsonl"),
        hyperparameters={**HP, "max_steps": 300, "checkpoint_every": 50},
    )
    proc, log = start_runner(db_url, job_id, tmp_path)
    try:
        # Most steps lie well between two checkpoints (41 of every 50), so however fast the steps and the
        # row's updates go, the poll sees one long before the run could end; a runner that ends first
        # fails here at once, with its log.
        seen = wait_for(
            lambda: (
                "exited"
                if proc.poll() is not None
                else (step := job_row(db_url, job_id).global_step) >= 55 and 5 <= step % 50 <= 45
            ),
            120,
            "a step between two checkpoints",
            log,
        )
        assert seen is True, f"the runner exited (rc {proc.returncode}) first:\n{log.read_text()[-5000:]}"
        proc.send_signal(signal.SIGKILL)  # e.g. the OOM killer: the steps since the checkpoint are replayed
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = job_row(db_url, job_id).global_step
    newest = max(checkpoint_rows(db_url, job_id))
    assert killed_at > newest
    with session_scope(db_url) as s:  # as if the database had lost the newest row, and kept a stale one
        s.execute(
            text("DELETE FROM fine_tuning_job_checkpoints WHERE job_id = :j AND step_number = :n"),
            {"j": job_id, "n": newest},
        )
        s.add(
            JobCheckpoint(
                job_id=job_id, step_number=5, path=str(tmp_path / "gone"), fine_tuned_model_checkpoint="x"
            )
        )
    proc, log = start_runner(db_url, job_id, tmp_path)
    assert proc.wait(180) == 0, log.read_text()[-5000:]
    assert_complete(db_url, job_id)  # one "Step N" event for each step, the rows as on disk
    msgs = [e.message for e in events(db_url, job_id)]
    assert f"Checkpoint at step {newest} found on disk; registered" in msgs
    assert any(m.startswith(f"Training resumed at step {newest}:") for m in msgs), msgs
    assert job_row(db_url, job_id).attempts == 1


# --- the writer and the sanitizer on their own ------------------------------------------------------


def _running_job(url: str, tmp_path: Path) -> str:
    from store.orm import utcnow

    return make_job(
        url,
        sums_file(tmp_path / "d.jsonl", n=8),
        status="running",
        worker_hostname=HOSTNAME,
        heartbeat_at=utcnow(),
        attempts=1,
    )


def test_writer_buffers_in_order_through_an_outage_with_bounded_memory(db_url: str, tmp_path: Path) -> None:
    from worker.job.writer import ReportWriter, Write, event_row

    job_id = _running_job(db_url, tmp_path)
    lost: list[bool] = []
    w = ReportWriter(
        db_url, job_id, HOSTNAME, outage_seconds=60, max_items=20, on_lost=lambda: lost.append(True)
    )
    w.start()
    try:
        with database_away(db_url):
            for i in range(20):
                w.put(
                    Write(
                        job={"global_step": i + 1},
                        events=[event_row(f"event {i}")],
                        metric={"step": i + 1, "train_loss": 1.0 / (i + 1)},
                    )
                )
            # the buffer is full: the next put waits for the database (training waits, memory stays bounded)
            blocked = threading.Thread(
                target=lambda: w.put(Write(events=[event_row("event 20")])), daemon=True
            )
            blocked.start()
            blocked.join(1.5)
            assert blocked.is_alive() and w.pending() == 20
            assert not w.flush(1.0)
        blocked.join(30)
        assert not blocked.is_alive()
        assert w.flush(30)
    finally:
        w.close()
    msgs = [e.message for e in events(db_url, job_id) if e.message.startswith("event ")]
    assert msgs == [f"event {i}" for i in range(21)]
    assert metric_steps(db_url, job_id) == list(range(1, 21)) and job_row(db_url, job_id).global_step == 20
    assert not lost and not w.interrupted.is_set()


def test_writer_interrupts_after_the_window_and_spools(db_url: str, tmp_path: Path) -> None:
    from worker.job.writer import ReportWriter, Write, event_row

    job_id = _running_job(db_url, tmp_path)
    spool = tmp_path / "spool.jsonl"
    w = ReportWriter(db_url, job_id, HOSTNAME, outage_seconds=1.0, max_items=100, on_lost=lambda: None)
    w.start()
    with database_away(db_url):
        w.put(Write(events=[event_row("before")], metric={"step": 1, "train_loss": 0.5}))
        assert wait_for(w.interrupted.is_set, 30, "the window to pass")
        assert not w.flush()
        w.put(Write(events=[event_row("after")]))  # never blocks once interrupted
        left = w.close()
        assert len(left) == 2 and w.save_spool(spool, left)
    assert events(db_url, job_id) == []
    nxt = ReportWriter(db_url, job_id, HOSTNAME, outage_seconds=60, max_items=100, on_lost=lambda: None)
    assert nxt.load_spool(spool) == 2
    nxt.put(Write(events=[event_row("next run")]))
    nxt.start()
    try:
        assert nxt.flush(30)
    finally:
        nxt.close()
    assert [e.message for e in events(db_url, job_id)] == ["before", "after", "next run"]
    assert not spool.exists() and metric_steps(db_url, job_id) == [1]
    # a spool read twice (the process died before deleting it) writes nothing twice
    nxt.save_spool(spool, left)
    again = ReportWriter(db_url, job_id, HOSTNAME, outage_seconds=60, max_items=100, on_lost=lambda: None)
    again.load_spool(spool)
    again.start()
    try:
        assert again.flush(30)
    finally:
        again.close()
    assert [e.message for e in events(db_url, job_id)] == ["before", "after", "next run"]


def test_writer_writes_nothing_for_a_job_taken_away(db_url: str, tmp_path: Path) -> None:
    """The job re-queued (by the reaper, after a long outage) while writes of this run wait: they are
    dropped and the process leaves (on_lost), so nothing of this run lands in the job's next one."""
    from worker.job.writer import ReportWriter, Write, event_row

    job_id = _running_job(db_url, tmp_path)
    lost = threading.Event()
    w = ReportWriter(db_url, job_id, HOSTNAME, outage_seconds=60, max_items=100, on_lost=lost.set)
    w.start()
    try:
        with session_scope(db_url) as s:  # the reaper holds the row lock while the write comes in
            s.execute(text("SELECT 1 FROM fine_tuning_jobs WHERE id = :j FOR UPDATE"), {"j": job_id})
            w.put(
                Write(
                    job={"global_step": 9}, events=[event_row("stale")], metric={"step": 9, "train_loss": 1.0}
                )
            )
            time.sleep(0.5)
            s.execute(
                text("UPDATE fine_tuning_jobs SET status = 'queued', worker_hostname = NULL WHERE id = :j"),
                {"j": job_id},
            )
        assert lost.wait(30) and w.lost
    finally:
        w.close()
    assert events(db_url, job_id) == [] and metric_steps(db_url, job_id) == []
    assert job_row(db_url, job_id).global_step == 0


def test_refused_write_fails_with_a_message_without_sql(db_url: str, tmp_path: Path) -> None:
    """A write the database refuses for good (an out-of-range value) is no outage: the writes before it
    go in, then the reporter raises a user-safe error naming the database's error class only."""
    from worker.job.writer import ReportingError, ReportWriter, Write, event_row

    job_id = _running_job(db_url, tmp_path)
    w = ReportWriter(db_url, job_id, HOSTNAME, outage_seconds=60, max_items=100, on_lost=lambda: None)
    with database_away(db_url):  # piled up, so they go in one batch once the database is back
        w.start()
        w.put(Write(events=[event_row("fine")]))
        w.put(Write(job={"total_steps": 2**40}, events=[event_row("too big")]))
        w.put(Write(events=[event_row("never")]))
    try:
        wait_for(lambda: w.fatal is not None, 30, "the refusal")
        with pytest.raises(ReportingError) as err:
            w.put(Write(events=[event_row("more")]))
    finally:
        w.close()
    assert str(err.value) == "database error (NumericValueOutOfRange)"
    assert [e.message for e in events(db_url, job_id)] == ["fine"]


def test_public_message_never_carries_sql(db_url: str) -> None:
    from sqlalchemy import update

    from worker.errors import is_db_unavailable, public_message, scrub

    eng = get_engine(db_url)
    with eng.connect() as conn:
        conn.execute(text("SELECT 1"))
        terminate_backends(db_url)
        with pytest.raises(Exception) as dropped:
            conn.execute(
                update(FineTuningJob).where(FineTuningJob.id == "ftjob-secret").values(global_step=346)
            )
    assert "UPDATE fine_tuning_jobs" in str(dropped.value)  # what reached users before
    assert is_db_unavailable(dropped.value)
    assert public_message(dropped.value) == "database unavailable (AdminShutdown)"
    with eng.connect() as conn, pytest.raises(Exception) as refused:
        conn.execute(text("SELECT CAST(:v AS integer)"), {"v": 2**40})
    assert not is_db_unavailable(refused.value)
    assert public_message(refused.value) == "database error (NumericValueOutOfRange)"
    try:  # raised while handling one: still the database's error, not the wrapper's text
        raise RuntimeError(f"report failed: {refused.value}") from refused.value
    except RuntimeError as e:
        assert public_message(e) == "database error (NumericValueOutOfRange)"
    assert public_message(ValueError("bad value")) == "ValueError: bad value"
    assert scrub("boom\n[SQL: SELECT secret FROM t]\n[parameters: {'k': 'v'}]") == "boom"
    assert len(public_message(ValueError("x" * 10_000))) <= 2000

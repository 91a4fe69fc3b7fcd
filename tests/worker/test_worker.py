"""The job runner and the Celery worker against the real PostgreSQL and Redis.

Claim and reaper rules run on the database alone; the runner runs in-process; the worker tests start
real ``celery -A worker worker`` processes on a private queue and kill parts of them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from contract.job import JobRequest
from store.db import session_scope
from store.orm import (
    File,
    FineTuningJob,
    JobCheckpoint,
    JobEvent,
    JobRun,
    JobStepMetric,
    RegisteredModel,
    Team,
    as_utc,
    utcnow,
)
from store.settings import Settings
from tests.support import heartbeat_timeout
from tests.worker.claims import claim_job

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def sums_file(path: Path, n: int = 64) -> Path:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"{a}+{b}?"},
                            {"role": "assistant", "content": str(a + b)},
                        ]
                    }
                )
                + "\n"
            )
    return path


def make_job(
    url: str,
    data: Path,
    *,
    hyperparameters: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    status: str = "queued",
    queue: str = "gpu-default",
    **cols: Any,
) -> str:
    with session_scope(url) as s:
        team = Team(name=f"t-{os.urandom(6).hex()}")
        s.add(team)
        s.flush()
        f = File(
            team_id=team.id,
            filename=data.name,
            purpose="fine-tune",
            bytes=data.stat().st_size,
            sha256="0" * 64,
            storage_path=str(data),
            num_examples=0,
        )
        s.add(f)
        s.flush()
        hp = {
            "n_epochs": 1,
            "batch_size": 4,
            "max_seq_length": 64,
            "checkpoint_every": 5,
            **(hyperparameters or {}),
        }
        resources = cols.pop("resources", None)
        method = hp.pop("dpo", None)
        request = JobRequest.model_validate(
            {
                "model": "tiny-llama",
                "training_file": f.id,
                "hyperparameters": hp,
                "engine": engine or {"mode": "device"},
                **({"resources": resources} if resources else {}),
                **({"method": {"type": "dpo", **method}} if method is not None else {}),
            }
        )
        job = FineTuningJob(
            team_id=team.id,
            model="tiny-llama",
            training_file_id=f.id,
            status=status,
            request=request,  # not resolved: the worker resolves it, as a job created before resolutions
            seed=1,
            queue=queue,
            **cols,
        )
        s.add(job)
        s.flush()
        return job.id


def get_job(url: str, job_id: str) -> FineTuningJob:
    with session_scope(url) as s:
        job = s.get(FineTuningJob, job_id)
        assert job is not None
        s.expunge(job)
        return job


def model_path(url: str, model_id: str) -> Path:
    """The folder a fine-tuned model's ``ft:`` id names (store.model_ids)."""
    with session_scope(url) as s:
        row = s.get(RegisteredModel, model_id)
        assert row is not None and row.deleted_at is None, model_id
        return Path(row.path)


def messages(url: str, job_id: str) -> list[str]:
    with session_scope(url) as s:
        return list(
            s.scalars(select(JobEvent.message).where(JobEvent.job_id == job_id).order_by(JobEvent.seq))
        )


def wait_for(
    cond: Callable[[], Any],
    timeout: float,
    what: str,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.1)
    tail = log.read_text()[-4000:] if log is not None and log.exists() else ""
    raise AssertionError(f"timed out waiting for {what}\n{tail}")


@pytest.fixture
def settings(service_env: dict[str, str]) -> Settings:
    from store.settings import get_settings

    return get_settings()


# --- claim / requeue / reaper rules (database only) -------------------------------------------


def test_claim_rules(settings: Settings, tmp_path: Path) -> None:

    url, data = settings.resolved_database_url, sums_file(tmp_path / "d.jsonl")
    fresh = make_job(url, data, status="running", worker_hostname="w1@h", heartbeat_at=utcnow())
    assert claim_job(fresh, "w2@h", settings) == "running-elsewhere"  # a redelivered message: no second run
    assert claim_job(fresh, "w1@h", settings) == "claimed"  # same node again: its previous run is dead
    assert get_job(url, fresh).attempts == 1
    stale = make_job(
        url,
        data,
        status="running",
        worker_hostname="w1@h",
        heartbeat_at=utcnow() - timedelta(seconds=settings.heartbeat_timeout_seconds + 5),
    )
    assert claim_job(stale, "w2@h", settings) == "claimed"
    assert get_job(url, stale).worker_hostname == "w2@h"
    done = make_job(url, data, status="succeeded")
    assert claim_job(done, "w1@h", settings) == "terminal"
    cancelled = make_job(url, data, cancel_requested=True)
    assert claim_job(cancelled, "w1@h", settings) == "cancelled"
    assert get_job(url, cancelled).status == "cancelled"
    worn = make_job(url, data, attempts=settings.max_job_attempts)
    assert claim_job(worn, "w1@h", settings) == "failed"
    assert get_job(url, worn).error["code"] == "max_attempts_exceeded"  # type: ignore[index]
    assert claim_job("ftjob-missing", "w1@h", settings) == "missing"


def test_requeue_after_abnormal_exit(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker.task as w
    from worker.job.exits import EXIT_PREEMPTED

    sent: list[tuple[str, str | None]] = []
    monkeypatch.setattr(w, "enqueue_job", lambda job_id, queue=None: sent.append((job_id, queue)))
    url, data = settings.resolved_database_url, sums_file(tmp_path / "d.jsonl")
    job = make_job(url, data, queue="gpu-x")
    assert claim_job(job, "w1@h", settings) == "claimed"
    assert w.finish_after_exit(job, -signal.SIGKILL, "w1@h", settings) == "requeued"
    j = get_job(url, job)
    assert (j.status, j.attempts, j.worker_hostname, sent) == ("queued", 1, None, [(job, "gpu-x")])
    assert "killed by SIGKILL" in messages(url, job)[-1]
    assert claim_job(job, "w1@h", settings) == "claimed"
    assert w.finish_after_exit(job, EXIT_PREEMPTED, "w1@h", settings) == "requeued"
    assert get_job(url, job).attempts == 1  # preemption does not count
    for _ in range(settings.max_job_attempts - 1):
        claim_job(job, "w1@h", settings)
    assert w.finish_after_exit(job, 1, "w1@h", settings) == "failed"
    assert get_job(url, job).error["code"] == "worker_lost"  # type: ignore[index]


def test_reaper(settings: Settings, tmp_path: Path) -> None:
    from store.runs import open_run
    from worker.reaper import reap_stale_jobs

    url, data = settings.resolved_database_url, sums_file(tmp_path / "d.jsonl")
    old = utcnow() - timedelta(seconds=settings.heartbeat_timeout_seconds + 60)
    stale = make_job(  # 9 steps run, the last checkpoint at step 7: it resumes from 7 (issue 25)
        url,
        data,
        status="running",
        worker_hostname="dead@h",
        heartbeat_at=old,
        attempts=1,
        global_step=9,
        last_checkpoint_path="/jobs/stale/checkpoint-000007",
    )
    fresh = make_job(url, data, status="running", worker_hostname="live@h", heartbeat_at=utcnow(), attempts=1)
    worn = make_job(
        url,
        data,
        status="running",
        worker_hostname="dead@h",
        heartbeat_at=old,
        attempts=settings.max_job_attempts,
    )
    cancel = make_job(
        url,
        data,
        status="running",
        worker_hostname="dead@h",
        heartbeat_at=old,
        attempts=1,
        cancel_requested=True,
    )
    mine = make_job(url, data, status="running", worker_hostname="me@h", heartbeat_at=utcnow(), attempts=1)
    with session_scope(url) as s:  # the stale job's run: 2 GPUs since 100 s before its last heartbeat
        open_run(s, s.get(FineTuningJob, stale), "dead@h", gpus=2, now=old - timedelta(seconds=100))
    sent: list[str] = []
    got = reap_stale_jobs(settings=settings, enqueue=lambda j, q: sent.append(j))
    assert stale in got and fresh not in got and mine not in got and set(got) == set(sent)
    with session_scope(url) as s:  # billed to its last heartbeat, not to the reaper's round
        (run,) = s.scalars(select(JobRun).where(JobRun.job_id == stale))
        assert as_utc(run.ended_at) == as_utc(old) and run.gpu_seconds == pytest.approx(200.0)
    assert (
        get_job(url, stale).status == "queued"
        and "re-queued to resume from step 7" in messages(url, stale)[-1]
    )
    assert get_job(url, fresh).status == "running"
    assert get_job(url, worn).status == "failed" and get_job(url, cancel).status == "cancelled"
    # A restarted node re-queues what it was running before it started, however fresh the heartbeat.
    assert mine in reap_stale_jobs(
        settings=settings,
        own_hostname="me@h",
        own_before=utcnow() + timedelta(seconds=1),
        enqueue=lambda j, q: None,
    )
    assert reap_stale_jobs(settings=settings, enqueue=lambda j, q: None) == []


def test_worker_beats_while_its_runner_starts(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until the runner's monitor beats (after its interpreter start, imports and loading the job: seconds
    on a loaded machine), the worker waiting on it keeps the job's heartbeat fresh, so a reaper with a
    short timeout never takes a job that is starting for dead (issue 21: re-queued as stale, twice)."""
    import worker.task as w
    from store import jobs
    from trainer.run.launch import NodeRanks

    url = settings.resolved_database_url
    interval = 0.2
    timeout = heartbeat_timeout(interval)
    fast = settings.model_copy(
        update={"heartbeat_interval_seconds": interval, "heartbeat_timeout_seconds": timeout}
    )
    job_id = make_job(url, sums_file(tmp_path / "d.jsonl"))
    assert claim_job(job_id, "w1@h", fast) == "claimed"
    # a runner that never beats, for longer than the timeout: only the worker keeps the job alive
    sleeper = [sys.executable, "-c", f"import time; time.sleep({timeout + 2:.1f})"]
    monkeypatch.setattr(
        w,
        "rank_launch",
        lambda *a, **k: NodeRanks(
            sleeper, nproc_per_node=1, run_id="sleeper", devices=None, env=dict(os.environ)
        ),
    )
    monkeypatch.setattr(w, "_POLL_SECONDS", interval)
    stale: list[float] = []  # heartbeat ages the reaper and the claim would have taken for a dead worker
    done = threading.Event()

    def watch() -> None:  # the reaper's and the claim's rule (store.jobs.heartbeat_is_fresh), this job only
        while not done.wait(interval):
            hb = get_job(url, job_id).heartbeat_at
            if not jobs.heartbeat_is_fresh(hb, timeout):
                stale.append((utcnow() - hb).total_seconds() if hb else float("inf"))

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        assert w.run_child(job_id, "w1@h", fast) == 0
    finally:
        done.set()
        t.join(30)
        with session_scope(url) as s:  # no running job left behind for the other tests' reapers
            jobs.cancel(s, jobs.lock_job(s, job_id), "test over")
    assert not stale, f"heartbeat older than the {timeout:.1f} s timeout: {stale}"


# --- the runner, in-process -------------------------------------------------------------------


def test_job_runner_reports_to_the_database(settings: Settings, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from worker.job.runner import run_job_process

    url = settings.resolved_database_url
    job_id = make_job(url, sums_file(tmp_path / "d.jsonl", n=40), hyperparameters={"checkpoint_every": 4})
    assert run_job_process(job_id) == 0
    job = get_job(url, job_id)
    assert job.status == "succeeded" and job.attempts == 1 and job.global_step == job.total_steps == 10
    assert job.trained_tokens and job.resolution is not None
    # made without a resolution (as a job created before they were recorded): the worker resolved it
    (run,) = job.resolutions
    assert run.at == "run" and run.job.hyperparameters.batch_size == 4 and run.job.engine.mode == "device"
    assert run.job.sources["engine.mode"] == "request" and run.machine is not None and run.num_examples == 40
    assert job.output_dir == str(settings.resolved_jobs_dir / job_id)
    assert job.fine_tuned_model and job.fine_tuned_model.startswith("ft:tiny-llama:t-")
    assert job.fine_tuned_model.endswith(f"::{job_id}")
    assert model_path(url, job.fine_tuned_model) == Path(job.output_dir) / "final"
    AutoModelForCausalLM.from_pretrained(model_path(url, job.fine_tuned_model), local_files_only=True)
    with session_scope(url) as s:
        metrics = s.scalars(
            select(JobStepMetric).where(JobStepMetric.job_id == job_id).order_by(JobStepMetric.step)
        ).all()
        ckpts = s.scalars(
            select(JobCheckpoint).where(JobCheckpoint.job_id == job_id).order_by(JobCheckpoint.step_number)
        ).all()
        assert [m.step for m in metrics] == list(range(1, 11)) and all(m.train_loss and m.lr for m in metrics)
        # keep_checkpoints=3: the step-4 checkpoint was pruned along with its row.
        assert [c.step_number for c in ckpts] == [8, 10] or [c.step_number for c in ckpts] == [4, 8, 10]
        assert ckpts[-1].path == job.last_checkpoint_path and "train_loss" in ckpts[-1].metrics
        # each checkpoint row's id is a live model of the team; a pruned one's id is gone with its files
        live = {
            m.id: m.path
            for m in s.scalars(
                select(RegisteredModel).where(
                    RegisteredModel.job_id == job_id, RegisteredModel.deleted_at.is_(None)
                )
            )
        }
        assert live == {
            job.fine_tuned_model: str(Path(job.output_dir) / "final"),
            **{c.fine_tuned_model_checkpoint: c.path for c in ckpts},
        }
        assert all(
            c.fine_tuned_model_checkpoint == f"{job.fine_tuned_model}:ckpt-step-{c.step_number}"
            for c in ckpts
        )
    msgs = messages(url, job_id)
    assert any(m.startswith("Validated training file: 40 examples") for m in msgs)
    assert "Step 10/10: training loss=" in " ".join(msgs) and msgs[-1].startswith("Job succeeded")


def test_job_runner_cancel_and_bad_data(settings: Settings, tmp_path: Path) -> None:
    from worker.job.runner import run_job_process

    url = settings.resolved_database_url
    job_id = make_job(
        url,
        sums_file(tmp_path / "d.jsonl", n=64),
        hyperparameters={"batch_size": 1, "n_epochs": 20, "checkpoint_every": 1000},
    )

    def cancel_soon() -> None:
        wait_for(lambda: get_job(url, job_id).global_step >= 3, 120, "step 3")
        with session_scope(url) as s:
            s.get(FineTuningJob, job_id).cancel_requested = True  # type: ignore[union-attr]

    t = threading.Thread(target=cancel_soon, daemon=True)
    t.start()
    assert run_job_process(job_id) == 0
    t.join(5)
    job = get_job(url, job_id)
    assert job.status == "cancelled" and job.fine_tuned_model is None and job.global_step < job.total_steps  # type: ignore[operator]
    assert job.last_checkpoint_path and job.last_checkpoint_path.endswith(f"checkpoint-{job.global_step:06d}")

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "bot", "content": "hi"}]}\n')
    job_id = make_job(url, bad)
    assert run_job_process(job_id) == 0
    job = get_job(url, job_id)
    assert job.status == "failed" and job.error["code"] == "invalid_training_file"  # type: ignore[index]
    assert job.error["param"] == "training_file" and "line 1: messages[0].role" in job.error["message"]  # type: ignore[index]


# --- real workers on Redis --------------------------------------------------------------------


class Workers:
    """Start ``celery -A worker worker`` processes for one queue; stop them all at the end."""

    def __init__(self, settings: Settings, redis_url: str, queue: str, tmp_path: Path) -> None:
        self.settings, self.queue, self.tmp = settings, queue, tmp_path
        self.env = {
            **os.environ,
            "ZENFLOW_BROKER_URL": redis_url,
            "ZENFLOW_DATABASE_URL": settings.resolved_database_url,
            "ZENFLOW_DATA_DIR": str(settings.data_dir),
            "ZENFLOW_DEFAULT_QUEUE": queue,
            "ZENFLOW_HEARTBEAT_INTERVAL_SECONDS": "1",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            # The session database holds the rule tests' queued jobs (on other queues): the
            # workers' reapers are not to send them to the shared Redis (tests/worker/test_dispatch.py).
            "ZENFLOW_DISPATCH_GRACE_SECONDS": "86400",
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self.log = tmp_path / "worker.log"

    def start(self, name: str, **env: str) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "worker",
            "worker",
            "--pool",
            "solo",
            "-Q",
            self.queue,
            "-n",
            f"{name}@test",
            "--loglevel",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        logf = self.log.open("ab")
        p = subprocess.Popen(cmd, env={**self.env, **env}, stdout=logf, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def enqueue(self, job_id: str) -> None:
        from worker.broker import configure_celery, enqueue_job

        configure_celery(self.settings.model_copy(update={"broker_url": self.env["ZENFLOW_BROKER_URL"]}))
        try:
            enqueue_job(job_id, queue=self.queue)
        finally:
            configure_celery()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


@pytest.fixture
def workers(
    settings: Settings, redis_broker_url: str, unique_queue: str, tmp_path: Path
) -> Iterator[Workers]:
    w = Workers(settings, redis_broker_url, unique_queue, tmp_path)
    yield w
    w.stop()


def runner_pids(worker_pid: int) -> list[int]:
    """PIDs of the job-runner processes of a worker process (children of its elastic agent)."""
    parents: dict[int, int] = {}
    runners = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if b"worker.job.runner" in (d / "cmdline").read_bytes():
                runners.append(int(d.name))
        except (OSError, IndexError, ValueError):
            continue
    return [p for p in runners if parents.get(parents.get(p, 0)) == worker_pid]


def _steps(url: str, job_id: str) -> list[int]:
    with session_scope(url) as s:
        return list(
            s.scalars(
                select(JobStepMetric.step).where(JobStepMetric.job_id == job_id).order_by(JobStepMetric.step)
            )
        )


def test_worker_runs_a_job_through_redis(workers: Workers, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    url = workers.settings.resolved_database_url
    proc = workers.start("w1")
    job_id = make_job(url, sums_file(tmp_path / "d.jsonl", n=24), queue=workers.queue)
    workers.enqueue(job_id)
    wait_for(lambda: get_job(url, job_id).status == "succeeded", 240, "the job to succeed", proc, workers.log)
    job = get_job(url, job_id)
    assert job.attempts == 1 and job.worker_hostname == "w1@test" and job.global_step == 6
    with session_scope(url) as s:
        assert (
            s.scalar(select(func.count()).select_from(JobCheckpoint).where(JobCheckpoint.job_id == job_id))
            == 2
        )
    AutoModelForCausalLM.from_pretrained(model_path(url, str(job.fine_tuned_model)), local_files_only=True)
    assert "Attempt 1/3 started on w1@test" in messages(url, job_id)


def test_killed_runner_is_requeued_and_resumed(workers: Workers, tmp_path: Path) -> None:
    url = workers.settings.resolved_database_url
    proc = workers.start("w1")
    job_id = make_job(
        url,
        sums_file(tmp_path / "d.jsonl", n=64),
        queue=workers.queue,
        hyperparameters={"batch_size": 1, "n_epochs": 2, "max_steps": 100, "checkpoint_every": 10},
    )
    workers.enqueue(job_id)
    wait_for(lambda: get_job(url, job_id).last_checkpoint_path, 240, "a checkpoint", proc, workers.log)
    pids = wait_for(lambda: runner_pids(proc.pid), 10, "the runner process")
    os.kill(pids[0], signal.SIGKILL)  # e.g. the kernel's OOM killer
    wait_for(
        lambda: get_job(url, job_id).status == "succeeded",
        300,
        "the resumed job to succeed",
        proc,
        workers.log,
    )
    job = get_job(url, job_id)
    msgs = messages(url, job_id)
    assert job.attempts == 2 and job.global_step == 100
    assert any("killed by SIGKILL" in m and "re-queued to resume" in m for m in msgs)
    resumed = [m for m in msgs if m.startswith("Training resumed at step ")]
    assert resumed and int(resumed[0].split()[4].rstrip(":")) % 10 == 0
    assert _steps(url, job_id) == list(range(1, 101))


def test_warm_shutdown_preempts_and_another_worker_resumes(workers: Workers, tmp_path: Path) -> None:
    url = workers.settings.resolved_database_url
    first = workers.start("w1")
    job_id = make_job(
        url,
        sums_file(tmp_path / "d.jsonl", n=64),
        queue=workers.queue,
        hyperparameters={"batch_size": 1, "n_epochs": 2, "max_steps": 100, "checkpoint_every": 50},
    )
    workers.enqueue(job_id)
    wait_for(lambda: get_job(url, job_id).global_step >= 5, 240, "training to start", first, workers.log)
    first.send_signal(signal.SIGTERM)  # warm shutdown: the job checkpoints and goes back to the queue
    assert first.wait(120) == 0
    job = get_job(url, job_id)
    assert job.status == "queued" and job.attempts == 0 and job.last_checkpoint_path
    assert "preempted" in messages(url, job_id)[-1]
    second = workers.start("w2")
    wait_for(
        lambda: get_job(url, job_id).status == "succeeded", 300, "the job to succeed", second, workers.log
    )
    assert get_job(url, job_id).worker_hostname == "w2@test" and _steps(url, job_id) == list(range(1, 101))


@pytest.mark.slow
def test_killed_worker_is_reaped_and_resumed(workers: Workers, tmp_path: Path) -> None:
    url = workers.settings.resolved_database_url
    first = workers.start("w1")
    job_id = make_job(
        url,
        sums_file(tmp_path / "d.jsonl", n=64),
        queue=workers.queue,
        hyperparameters={"batch_size": 1, "n_epochs": 2, "max_steps": 100, "checkpoint_every": 10},
    )
    started = time.monotonic()
    workers.enqueue(job_id)
    wait_for(lambda: get_job(url, job_id).last_checkpoint_path, 240, "a checkpoint", first, workers.log)
    first_ten = time.monotonic() - started  # a runner's start-up and 10 steps, on this machine now
    runner = wait_for(lambda: runner_pids(first.pid), 10, "the runner process")[0]
    first.kill()  # the whole worker dies; the runner follows it (PR_SET_PDEATHSIG)
    first.wait(10)
    wait_for(
        lambda: (
            not Path(f"/proc/{runner}").exists() or b"Z" in Path(f"/proc/{runner}/stat").read_bytes()[:64]
        ),
        10,
        "the runner to die with its worker",
    )
    assert get_job(url, job_id).status == "running"  # nobody can tell yet
    # The second worker's reaper must take w1's job for dead, and never its own live run of it: a
    # timeout derived from how slow this machine is now (tests.support.heartbeat_timeout), not a
    # fixed 4 s that a loaded machine's start-up outruns (issue 21: attempts 3).
    timeout = heartbeat_timeout(float(workers.env["ZENFLOW_HEARTBEAT_INTERVAL_SECONDS"]))
    second = workers.start("w2", ZENFLOW_HEARTBEAT_TIMEOUT_SECONDS=f"{timeout:.1f}")
    # the reaper's round after the timeout, then at most 90 steps more and a start-up: 10 x the first ten
    wait_for(
        lambda: get_job(url, job_id).status == "succeeded",
        max(300.0, 1.5 * timeout + 10 * first_ten),
        "the reaped job to succeed",
        second,
        workers.log,
    )
    job = get_job(url, job_id)
    assert job.attempts == 2 and job.worker_hostname == "w2@test", (job.attempts, messages(url, job_id))
    assert any("lost (no heartbeat" in m for m in messages(url, job_id))


@pytest.mark.services  # an in-process Celery worker that spawns the job runner
def test_embedded_worker_on_sqlite_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``zenflow serve``'s in-process worker on the embedded defaults: SQLite database, kombu SQLAlchemy broker."""
    from store.db import get_engine
    from store.orm import Base
    from store.settings import get_settings
    from worker.broker import configure_celery, enqueue_job
    from worker.embedded import start_embedded_worker

    for k in ("ZENFLOW_DATABASE_URL", "ZENFLOW_BROKER_URL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("ZENFLOW_DATA_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    get_settings.cache_clear()
    settings = get_settings()
    assert settings.embedded and settings.resolved_broker_url.startswith("sqla+sqlite:")
    url = settings.resolved_database_url
    Base.metadata.create_all(get_engine(url))
    worker = start_embedded_worker(settings=settings, hostname="embedded@test")
    try:
        job_id = make_job(url, sums_file(tmp_path / "d.jsonl", n=16), queue=settings.default_queue)
        enqueue_job(job_id, queue=settings.default_queue)
        wait_for(lambda: get_job(url, job_id).status in ("succeeded", "failed"), 240, "the job to finish")
        job = get_job(url, job_id)
        assert job.status == "succeeded" and job.worker_hostname == "embedded@test", job.error
        assert model_path(url, str(job.fine_tuned_model)).is_dir() and worker.is_alive()
    finally:
        worker.stop()
        configure_celery()
        get_engine.cache_clear()
        get_settings.cache_clear()
    assert not worker.is_alive()

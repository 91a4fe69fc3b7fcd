"""The job runner, in-process, paused by its row's ``pause_requested``: it stops at its next step with a
checkpoint there, writes ``paused`` (its run ended, its attempt given back, counted ``paused`` in the
worker's telemetry), and once resumed its next run goes on from that checkpoint to the end."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from sqlalchemy import select

from store import jobs
from store.db import session_scope
from store.jobs import request_pause, resume
from store.orm import JobCheckpoint, JobRun
from store.settings import Settings
from tests.worker.test_worker import get_job, make_job, messages, sums_file, wait_for

pytestmark = pytest.mark.usefixtures("torch_single_thread")

#: A runner's start on a loaded 2-core box (the model, the engine) before its first step.
START_S = 120.0


@pytest.fixture
def settings(service_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    from store.settings import get_settings

    # the monitor polls the row every heartbeat interval (at most 1 s): a pause lands within it
    monkeypatch.setenv("ZENFLOW_HEARTBEAT_INTERVAL_SECONDS", "0.2")
    get_settings.cache_clear()
    return get_settings()


def test_the_runner_pauses_at_its_next_step_and_the_resumed_run_goes_on_from_there(
    settings: Settings, tmp_path: Path
) -> None:
    from worker.job.runner import run_job_process
    from worker.metrics.telemetry import worker_telemetry

    url = settings.resolved_database_url
    job_id = make_job(
        url,
        sums_file(tmp_path / "d.jsonl", n=64),
        hyperparameters={"batch_size": 1, "n_epochs": 3, "checkpoint_every": 1000},
    )

    def pause_soon() -> None:
        wait_for(lambda: get_job(url, job_id).global_step >= 3, START_S, "step 3")
        with session_scope(url) as s:
            job = jobs.lock_job(s, job_id)
            assert job is not None
            request_pause(s, job)

    tel = worker_telemetry()
    base = {"worker": tel.worker, "hostname": tel.hostname, "gpu": tel.gpu, "status": "paused"}
    before = tel.registry.get_sample_value("zenflow_worker_jobs_total", base) or 0.0
    t = threading.Thread(target=pause_soon, daemon=True)
    t.start()
    assert run_job_process(job_id) == 0
    t.join(5)
    job = get_job(url, job_id)
    (at,) = [
        int(m.group(1)) for e in messages(url, job_id) if (m := re.match(r"Job paused at step (\d+)$", e))
    ]
    assert job.status == "paused" and 3 <= at < job.total_steps  # type: ignore[operator]
    assert (job.pause_requested, job.attempts, job.worker_hostname, job.fine_tuned_model) == (
        False,
        0,
        None,
        None,
    )
    assert job.last_checkpoint_path and job.last_checkpoint_path.endswith(f"checkpoint-{at:06d}")
    assert Path(job.last_checkpoint_path).is_dir()
    assert tel.registry.get_sample_value("zenflow_worker_jobs_total", base) == before + 1
    with session_scope(url) as s:
        (run,) = s.scalars(select(JobRun).where(JobRun.job_id == job_id)).all()
        assert run.ended_at is not None
        assert (
            s.scalar(select(JobCheckpoint.step_number).where(JobCheckpoint.path == job.last_checkpoint_path))
            == at
        )

    # resumed: queued again, claimed, and the run goes on from the checkpoint to the end
    with session_scope(url) as s:
        row = jobs.lock_job(s, job_id)
        assert row is not None
        resume(s, row)
    assert messages(url, job_id)[-1].startswith("Job resumed: queued to resume from step")
    assert run_job_process(job_id) == 0  # claimed here as a worker would
    job = get_job(url, job_id)
    assert job.status == "succeeded" and job.global_step == job.total_steps and job.attempts == 1
    assert any(m.endswith(f"resuming from step {at}") for m in messages(url, job_id))
    with session_scope(url) as s:
        assert len(s.scalars(select(JobRun).where(JobRun.job_id == job_id)).all()) == 2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_two_rank_job_pauses_on_both_ranks_at_one_step_and_resumes(
    settings: Settings, redis_broker_url: str, unique_queue: str, tmp_path: Path
) -> None:
    """A 2-rank job (gloo CPU ranks under a real ``python -m worker``) paused mid-run: rank 0 sees the
    request, the cancel vote stops both ranks at the same step, each writes its engine shard into the
    checkpoint there, both processes exit and the job is paused; resumed, it finishes on 2 ranks."""
    from tests.worker.test_multi_rank_job import Worker, rank_pids
    from tests.worker.test_multi_rank_job import make_job as make_ranked_job
    from tests.worker.test_multi_rank_job import wait_for as wait_logged
    from worker.broker import queue_for_gpus

    worker = Worker(settings, redis_broker_url, unique_queue, tmp_path)
    worker.env["ZENFLOW_HEARTBEAT_INTERVAL_SECONDS"] = "0.5"
    url, queue, steps = settings.resolved_database_url, queue_for_gpus(2, unique_queue), 40
    job_id = make_ranked_job(
        url,
        sums_file(tmp_path / "d.jsonl", n=64),
        queue=queue,
        gpus=2,
        hyperparameters={"batch_size": 2, "n_epochs": 2, "max_steps": steps, "checkpoint_every": 1000},
        engine={"mode": "zenflow", "update_interval": 2, "select_interval": 4},
    )
    try:
        worker.start()
        worker.enqueue(job_id, queue)
        wait_logged(lambda: get_job(url, job_id).global_step >= 2, 400, "two steps", log=worker.log)
        with session_scope(url) as s:
            job = jobs.lock_job(s, job_id)
            assert job is not None
            request_pause(s, job)
        job = wait_logged(
            lambda: (j := get_job(url, job_id)).status != "running" and j, 120, "the pause", log=worker.log
        )
        msgs = messages(url, job_id)
        (at,) = [int(m.group(1)) for e in msgs if (m := re.match(r"Job paused at step (\d+)$", e))]
        assert job.status == "paused" and 2 <= at < steps, msgs[-10:]
        checkpoint = Path(str(job.last_checkpoint_path))
        assert checkpoint.name == f"checkpoint-{at:06d}"
        shards = {p.name for p in checkpoint.glob("engine-rank*.pt")}  # each rank's, at the same step
        assert shards == {"engine-rank00000-of-00002.pt", "engine-rank00001-of-00002.pt"}, shards
        wait_logged(lambda: not rank_pids(job_id), 60, "both ranks to exit", log=worker.log)

        with session_scope(url) as s:
            row = jobs.lock_job(s, job_id)
            assert row is not None
            resume(s, row)
        worker.enqueue(job_id, queue)
        job = wait_logged(
            lambda: (j := get_job(url, job_id)).status in ("succeeded", "failed") and j,
            600,
            "the resumed job",
            log=worker.log,
        )
        msgs = messages(url, job_id)
        assert job.status == "succeeded" and job.global_step == steps, (job.error, msgs[-10:])
        assert any(m.endswith(f"resuming from step {at}") for m in msgs), msgs
    finally:
        worker.stop()
        with session_scope(url) as s:  # nothing left waiting for the other tests' claims
            row = jobs.lock_job(s, job_id)
            if row is not None and row.status in ("queued", "running", "paused"):
                jobs.cancel(s, row, "test over")

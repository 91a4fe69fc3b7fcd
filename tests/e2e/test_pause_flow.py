"""Pause and resume end to end, through the official openai SDK against a real Celery worker (real
PostgreSQL, Redis): a job paused while it runs stops at a step with its checkpoint kept, its run ended
and its process gone, waits paused while another job runs, and once resumed finishes with exactly the
weights of the same job run without a pause (fp32 on the CPU, every thread count pinned)."""

from __future__ import annotations

import io
import json
import re
import secrets
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from store.settings import Settings
from tests.api.conftest import TEST_API_SETTINGS, ServerThread, make_team
from tests.e2e.test_full_flow import running_worker
from tests.worker.test_worker import wait_for

pytestmark = pytest.mark.slow

#: The worker's heartbeat interval, which is also how often a job's monitor polls its row for a pause.
POLL_S = 0.25
#: A worker's start (its capacity measured in a subprocess that imports torch) or a runner's (interpreter,
#: torch, the model, the engine's extension) on a loaded 2-core box; the first step comes right after.
START_S = 300.0
#: From a pause request to ``paused``: a poll, the step under way, the checkpoint at the pause, the end
#: state written through the job's report writer: seconds, bounded generously for a loaded box.
PAUSE_S = 120.0
#: One whole run of the job below (64 steps of tiny-llama, 8 sequences of at most 128 tokens each).
RUN_S = 600.0

#: 64 steps; a checkpoint at 50 only (and at the end), so the pause writes its own checkpoint mid-run.
HYPERPARAMETERS = {"n_epochs": 4, "batch_size": 8, "max_seq_length": 128, "checkpoint_every": 50}
#: Everything that decides the bits: the engine's mode, its split of the cores and no thread pinned.
ENGINE = {"mode": "zenflow"}
TUNING = {"cpu_threads": 2, "bind_worker_cores": False}


@pytest.fixture
def flow_settings(settings: Settings, tmp_path: Path) -> Iterator[Settings]:
    import redis

    queue = f"zf-test-pause-{secrets.token_hex(4)}"
    yield settings.model_copy(update={"default_queue": queue, "data_dir": tmp_path / "var"})
    r = redis.Redis.from_url(settings.broker_url)
    for key in r.scan_iter(f"*{queue}*"):
        r.delete(key)


def _job(sdk: openai.OpenAI, job_id: str) -> dict[str, Any]:
    """The job object as the API sends it, extras (``progress``, ``pause_requested``) included."""
    got = sdk.get(f"/fine_tuning/jobs/{job_id}", cast_to=object)
    assert isinstance(got, dict)
    return got


def _events(sdk: openai.OpenAI, job_id: str) -> list[str]:
    return [e.message for e in reversed(sdk.fine_tuning.jobs.list_events(job_id, limit=1000).data)]


def _runner_pids(job_id: str) -> list[int]:
    """Processes running this job (its runner: ``python -m worker.job.runner JOB_ID``, or its agent)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(job_id.encode() in part for part in cmd):
            pids.append(int(proc.name))
    return pids


def _weights(http: httpx.Client, model_id: str) -> dict[str, Any]:
    """The model's tensors as GET /v1/models/{id}/content serves them."""
    from safetensors.torch import load

    r = http.get(f"/v1/models/{model_id}/content")
    assert r.status_code == 200, r.text
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        member = tar.extractfile("model.safetensors")
        assert member is not None
        return load(member.read())


def test_a_job_paused_and_resumed_through_the_sdk_ends_with_the_weights_of_an_uninterrupted_one(
    flow_settings: Settings, tmp_path: Path
) -> None:
    import torch
    from sqlalchemy import select

    from api.app import create_app
    from store.db import session_scope
    from store.orm import JobRun
    from store.worker_registry import live_workers
    from trainer.samples import TRAIN_FILE
    from worker.broker import configure_celery

    url, queue, log = (
        flow_settings.resolved_database_url,
        flow_settings.default_queue,
        tmp_path / "worker.log",
    )
    configure_celery(flow_settings)
    app = create_app(flow_settings, TEST_API_SETTINGS)
    team = make_team(app)
    env = {
        "ZENFLOW_HEARTBEAT_INTERVAL_SECONDS": str(POLL_S),
        "ZENFLOW_ENGINE_TUNING": json.dumps(TUNING),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    try:
        with (
            running_worker(flow_settings, tmp_path, "pause", **env) as worker,
            ServerThread(app) as server,
            httpx.Client(base_url=server.base_url, headers=team.headers, timeout=60) as http,
        ):
            sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=team.key, max_retries=0, timeout=60)

            def live() -> bool:  # the jobs are resolved at create for this worker's machine, then kept
                with session_scope(url) as s:
                    return bool(live_workers(s, queue, live_seconds=flow_settings.worker_live_seconds))

            wait_for(live, START_S, "the worker to register", worker, log)
            with TRAIN_FILE.open("rb") as f:
                fid = sdk.files.create(file=f, purpose="fine-tune").id

            def create() -> str:
                return sdk.fine_tuning.jobs.create(
                    model="tiny-llama",
                    training_file=fid,
                    seed=11,
                    extra_body={"hyperparameters": HYPERPARAMETERS, "engine": ENGINE},
                ).id

            # 1. Pause the job once it has reported a step.
            paused_id = create()
            wait_for(lambda: _job(sdk, paused_id)["progress"]["step"] >= 1, START_S, "a step", worker, log)
            asked = sdk.fine_tuning.jobs.pause(paused_id)
            assert asked.status == "running" and _job(sdk, paused_id)["pause_requested"] is True, (
                "the job ended before the pause reached it: give it more steps"
            )
            job = wait_for(
                lambda: (j := _job(sdk, paused_id))["status"] == "paused" and j,
                PAUSE_S,
                "paused",
                worker,
                log,
            )
            total = job["progress"]["total_steps"]
            (at,) = [
                int(m.group(1))
                for e in _events(sdk, paused_id)
                if (m := re.match(r"Job paused at step (\d+)$", e))
            ]
            assert 1 <= at < total and job["pause_requested"] is False and job["finished_at"] is None
            assert sdk.fine_tuning.jobs.retrieve(paused_id).status == "paused"  # the SDK parses the status
            # its checkpoint at the pause is kept, listed and on disk
            checkpoint = sdk.fine_tuning.jobs.checkpoints.list(paused_id).data[0]
            assert checkpoint.step_number == at
            assert (flow_settings.resolved_jobs_dir / paused_id / f"checkpoint-{at:06d}").is_dir()
            # its process is gone (the worker settled it as paused) and its GPUs are free (its run ended)
            wait_for(
                lambda: f"job {paused_id}: runner exited" in log.read_text(),
                PAUSE_S,
                "the runner",
                worker,
                log,
            )
            assert re.search(rf"job {paused_id}: runner exited \(exit code 0\): paused", log.read_text())
            assert _runner_pids(paused_id) == []
            with session_scope(url) as s:
                runs = s.scalars(select(JobRun).where(JobRun.job_id == paused_id)).all()
                assert len(runs) == 1 and runs[0].ended_at is not None
            assert http.get("/v1/quotas").json()["usage"]["running_jobs"] == 0

            # 2. The same job without a pause runs meanwhile; nothing takes the paused one.
            straight_id = create()
            wait_for(
                lambda: _job(sdk, straight_id)["status"] in ("succeeded", "failed"),
                RUN_S,
                "the job",
                worker,
                log,
            )
            straight = _job(sdk, straight_id)
            assert straight["status"] == "succeeded", (
                _events(sdk, straight_id)[-10:],
                log.read_text()[-3000:],
            )
            assert _job(sdk, paused_id)["status"] == "paused"

            # 3. Resume: back in the queue, on from the checkpoint, with the settings resolved at create.
            resumed = sdk.fine_tuning.jobs.resume(paused_id)
            assert resumed.status in ("queued", "running"), resumed
            wait_for(
                lambda: _job(sdk, paused_id)["status"] in ("succeeded", "failed"),
                RUN_S,
                "the resumed job",
                worker,
                log,
            )
            job = _job(sdk, paused_id)
            events = _events(sdk, paused_id)
            assert job["status"] == "succeeded", (events[-10:], log.read_text()[-3000:])
            assert any(e.startswith("Job resumed") for e in events)
            assert any(e.endswith(f"resuming from step {at}") for e in events), events
            assert job["trained_tokens"] == straight["trained_tokens"]
            assert len(job["resolutions"]) == len(straight["resolutions"]) == 1  # never decided again
            assert (job["engine"], job["hyperparameters"]) == (
                straight["engine"],
                straight["hyperparameters"],
            )

            a, b = _weights(http, job["fine_tuned_model"]), _weights(http, straight["fine_tuned_model"])
            assert a.keys() == b.keys() and a
            assert all(t.dtype == torch.float32 for t in a.values())
            differ = [k for k in a if not torch.equal(a[k], b[k])]
            assert not differ, f"tensors that differ after the pause and resume: {differ}"
            print(
                f"paused at step {at} of {total}, resumed: {len(a)} tensors equal to the uninterrupted run's"
            )
    finally:
        configure_celery()
        app.state.engine.dispose()

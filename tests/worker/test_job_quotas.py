"""A running job held to its team's quotas (issue 25, item 3), the runner in-process against the real
PostgreSQL: the GPU-hour quota, checked by the job's monitor, stops it within a heartbeat of the limit
with a checkpoint kept; a checkpoint that takes the team past its storage quota is removed and the job
stops, its previous checkpoint kept. Both fail ``quota_exceeded`` with one event saying so
(worker.job.quota_watch)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from store import quotas
from store.db import session_scope
from store.orm import FineTuningJob, JobCheckpoint
from store.settings import Settings
from store.usage import directory_bytes
from tests.support import heartbeat_timeout
from tests.worker.test_worker import get_job, make_job, messages, sums_file, wait_for

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture
def settings(service_env: dict[str, str]) -> Settings:
    from store.settings import get_settings

    return get_settings()


def _team(url: str, job_id: str) -> str:
    return get_job(url, job_id).team_id


def _set(url: str, team_id: str, **values: Any) -> None:
    with session_scope(url) as s:
        quotas.set_limits(s, team_id, values)


def _checkpoints(url: str, job_id: str) -> list[JobCheckpoint]:
    with session_scope(url) as s:
        rows = list(
            s.scalars(
                select(JobCheckpoint)
                .where(JobCheckpoint.job_id == job_id)
                .order_by(JobCheckpoint.step_number)
            )
        )
        s.expunge_all()
        return rows


def _quota_failure(url: str, job_id: str, quota: str) -> tuple[FineTuningJob, str]:
    """The job failed ``quota_exceeded`` on ``quota``, with that message as its one error event."""
    job = get_job(url, job_id)
    assert job.status == "failed", (job.status, messages(url, job_id)[-5:])
    assert job.error is not None and job.error["code"] == "quota_exceeded" and job.error["param"] == quota
    msg = job.error["message"]
    assert messages(url, job_id).count(msg) == 1 and messages(url, job_id)[-1] == msg
    return job, msg


def test_gpu_hour_quota_stops_a_running_job_within_a_heartbeat(settings: Settings, tmp_path: Path) -> None:
    """The limit is set while the job runs, two heartbeats' worth of GPU time above its use: the job
    stops no earlier than the limit, within a heartbeat of it (plus the step, checkpoint and end write
    under way: slack from the heartbeat interval and this machine's load), checkpointing where it stopped."""
    from worker.job.runner import run_job_process

    interval = 0.5
    fast = settings.model_copy(update={"heartbeat_interval_seconds": interval})
    url = settings.resolved_database_url
    job_id = make_job(
        url,
        sums_file(tmp_path / "d.jsonl", n=64),
        hyperparameters={"batch_size": 1, "n_epochs": 20, "checkpoint_every": 1000},
    )
    team = _team(url, job_id)
    reached_at: list[float] = []

    def set_limit_while_running() -> None:
        wait_for(lambda: get_job(url, job_id).global_step >= 3, 300, "step 3")
        _set(url, team, gpu_hours=1000)
        with session_scope(url) as s:
            gpu = quotas.gpu_hours_now(s, team, fast)
            assert gpu is not None and gpu.running_gpus == 1
            used = gpu.used_seconds
        _set(url, team, gpu_hours=(used + 2 * interval) / 3600)
        reached_at.append(time.monotonic() + 2 * interval)  # one GPU: the use grows a second a second

    t = threading.Thread(target=set_limit_while_running, daemon=True)
    t.start()
    assert run_job_process(job_id, settings=fast) == 0
    ended = time.monotonic()
    t.join(5)
    assert reached_at, "the limit was never set"
    job, msg = _quota_failure(url, job_id, "gpu_hours")
    assert ended - reached_at[0] <= interval + heartbeat_timeout(interval), ended - reached_at[0]
    assert job.global_step < job.total_steps  # type: ignore[operator]
    ckpts = _checkpoints(url, job_id)
    assert [c.step_number for c in ckpts] == [job.global_step]  # saved where it stopped
    assert job.last_checkpoint_path == ckpts[-1].path and Path(ckpts[-1].path).is_dir()
    assert msg.startswith("GPU-hour quota of ") and " reached: used " in msg, msg
    msgs = messages(url, job_id)
    assert f"Stopped at step {job.global_step}: GPU-hour quota" in msgs and not any(
        m.startswith("Cancelled") for m in msgs
    )
    assert msg.endswith(
        f"GPU-hours in the last 30 days; the job stopped at step {job.global_step}, "
        f"checkpoint {ckpts[-1].fine_tuned_model_checkpoint} kept"
    ), msg
    with session_scope(url) as s:  # the use recorded is at the limit or past it, never short of it
        gpu = quotas.gpu_hours_now(s, team, fast)
        assert gpu is not None and gpu.reached and gpu.running_gpus == 0


def test_storage_quota_at_a_checkpoint_stops_the_job_keeping_the_previous_one(
    settings: Settings, tmp_path: Path
) -> None:
    """Room for the upload and one and a half checkpoints: the second checkpoint is removed and the job
    stops there, the first kept; a run whose only checkpoint is its last fails the same way, none kept."""
    from worker.job.runner import run_job_process

    url = settings.resolved_database_url
    data = sums_file(tmp_path / "d.jsonl", n=64)
    hp = {"batch_size": 4, "n_epochs": 2, "checkpoint_every": 5}
    reference = make_job(url, data, hyperparameters={**hp, "max_steps": 5})  # a team without a quota
    assert run_job_process(reference, settings=settings) == 0
    size = directory_bytes(Path(get_job(url, reference).output_dir or "") / "checkpoint-000005")
    assert size > 0

    job_id = make_job(url, data, hyperparameters={**hp, "max_steps": 20})
    _set(url, _team(url, job_id), storage_bytes=data.stat().st_size + size * 3 // 2)
    assert run_job_process(job_id, settings=settings) == 0
    job, msg = _quota_failure(url, job_id, "storage_bytes")
    ckpts = _checkpoints(url, job_id)
    assert job.global_step == 10 and [c.step_number for c in ckpts] == [5]
    out = Path(job.output_dir or "")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-000005"]
    assert job.last_checkpoint_path == str(out / "checkpoint-000005")
    assert msg.startswith(
        f"Storage quota of {data.stat().st_size + size * 3 // 2:,} bytes reached: checkpoint 10 "
    )
    assert msg.endswith(
        f"so it was removed; the job stopped at step 10, checkpoint {ckpts[0].fine_tuned_model_checkpoint} kept"
    ), msg

    last_only = make_job(url, data, hyperparameters={**hp, "max_steps": 5})
    _set(url, _team(url, last_only), storage_bytes=data.stat().st_size + size // 2)
    assert run_job_process(last_only, settings=settings) == 0
    job, msg = _quota_failure(url, last_only, "storage_bytes")
    assert _checkpoints(url, last_only) == [] and job.fine_tuned_model is None
    assert msg.endswith("the job stopped at step 5, no checkpoint kept"), msg
    assert not any(Path(job.output_dir or "").glob("checkpoint-*"))

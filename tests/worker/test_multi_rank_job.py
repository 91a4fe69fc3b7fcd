"""A job on 2 ranks through the real worker path (``python -m worker --gpus-per-job 2`` on gloo
CPU ranks, PostgreSQL, Redis), and the worker's rules around a job's size: where its ranks come from,
jobs larger than the worker, the queues, the labels and exit codes of a rank."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from store.db import session_scope
from store.orm import JobEvent, JobRun, JobStepMetric, RegisteredModel
from store.orm import Worker as WorkerRow
from store.settings import Settings
from tests.worker.claims import claim_job
from tests.worker.test_worker import get_job, sums_file
from tests.worker.test_worker import make_job as make_worker_job

ROOT = Path(__file__).resolve().parents[2]


# --- helpers ---------------------------------------------------------------------------------------


def make_job(
    url: str,
    data: Path,
    *,
    queue: str,
    gpus: int | None,
    hyperparameters: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    **cols: Any,
) -> str:
    """A queued job on ``gpus`` ranks (None: no ``resources`` given), as test_worker's make_job."""
    resources = None if gpus is None else {"gpus": gpus}
    return make_worker_job(
        url, data, queue=queue, hyperparameters=hyperparameters, engine=engine, resources=resources, **cols
    )


def messages(url: str, job_id: str) -> list[str]:
    with session_scope(url) as s:
        return list(
            s.scalars(select(JobEvent.message).where(JobEvent.job_id == job_id).order_by(JobEvent.seq))
        )


def wait_for(
    cond: Callable[[], Any], timeout: float, what: str, *, log: Path | None = None, interval: float = 0.1
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(interval)
    tail = log.read_text(errors="replace")[-6000:] if log is not None and log.exists() else ""
    raise AssertionError(f"timed out waiting for {what}\n{tail}")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def rank_pids(job_id: str) -> dict[int, int]:
    """{rank: pid} of the live job-runner processes of ``job_id`` (rank from their environment)."""
    out: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            if b"worker.job.runner" not in cmd or job_id.encode() not in cmd or not alive(int(d.name)):
                continue
            env = dict(kv.split(b"=", 1) for kv in (d / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        out[int(env.get(b"RANK", b"0"))] = int(d.name)
    return out


@pytest.fixture
def settings(service_env: dict[str, str]) -> Settings:
    from store.settings import get_settings

    return get_settings()


# --- the worker's rules (no training) ------------------------------------------------------------


def test_rank_launch_takes_the_workers_gpus_or_cpu_ranks(settings: Settings) -> None:
    from trainer.run.launch import CPU_SHARE_ENV
    from worker.task import rank_launch, worker_ranks

    g = rank_launch("ftjob-x", 2, "w@h", settings, devices=["3", "5", "6"])
    assert (g.config.nproc_per_node, g.config.nnodes, g.config.gpus) == (2, 1, True)
    assert g.env["CUDA_VISIBLE_DEVICES"] == "3,5" and CPU_SHARE_ENV not in g.env  # rank r: the r-th GPU
    assert g.env["ZENFLOW_WORKER_HOSTNAME"] == "w@h" and g.config.run_id.startswith("ftjob-x-")
    assert g.config.cmd[-2:] == ["worker.job.runner", "ftjob-x"]
    cpu = rank_launch("ftjob-x", 2, "w@h", settings, devices=[])
    assert cpu.env["CUDA_VISIBLE_DEVICES"] == "" and cpu.env[CPU_SHARE_ENV] == "1" and not cpu.config.gpus
    one = rank_launch("ftjob-x", 1, "w@h", settings, devices=["3", "5"])
    assert one.config.nproc_per_node == 1 and one.env["CUDA_VISIBLE_DEVICES"] == "3"
    assert one.config.run_id != g.config.run_id  # one rendezvous per run
    for launch in (g, cpu, one):
        launch.close()

    assert worker_ranks(settings, ["0", "1"]) == 2 and worker_ranks(settings, []) == 1
    cpu_ok = settings.model_copy(update={"cpu_ranks": True, "gpus_per_job": 4})
    assert worker_ranks(cpu_ok, []) == 4 and worker_ranks(cpu_ok, ["0"]) == 1


def test_a_job_larger_than_the_worker_goes_to_the_queue_of_its_size(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never run on fewer ranks: back to ``<queue>-x4`` with the attempt counted; failed (with what to
    start) once no attempt is left. The run ledger counts the job's own size."""
    import worker.task as task

    sent: list[tuple[str, str | None]] = []
    monkeypatch.setattr(task, "enqueue_job", lambda job_id, queue=None: sent.append((job_id, queue)))
    url = settings.resolved_database_url
    job_id = make_job(url, sums_file(tmp_path / "d.jsonl"), queue="q-base", gpus=4)
    claimed = task.claim_next_job(job_id, "w@h", settings, queue="q-base")
    assert claimed.job_id == job_id and claimed.outcome.value == "claimed"
    assert task.claimed_ranks(job_id, settings) == 4
    with session_scope(url) as s:
        assert s.scalars(select(JobRun.gpus).where(JobRun.job_id == job_id)).all() == [4]
    assert task.send_back_oversized(job_id, 4, 2, "w@h", settings) == "requeued"
    j = get_job(url, job_id)
    assert (j.status, j.queue, j.attempts, sent) == ("queued", "q-base-x4", 1, [(job_id, "q-base-x4")])
    assert "needs 4 GPUs" in messages(url, job_id)[-1] and "runs jobs of 2" in messages(url, job_id)[-1]

    for _ in range(settings.max_job_attempts - 1):
        assert claim_job(job_id, "w@h", settings) == "claimed"
    assert task.send_back_oversized(job_id, 4, 2, "w@h", settings) == "failed"
    j = get_job(url, job_id)
    assert j.status == "failed" and j.error is not None and j.error["code"] == "insufficient_gpus"
    assert "--gpus-per-job 4" in j.error["message"] and "q-base-x4" in j.error["message"]


def test_queues_of_a_multi_rank_worker(settings: Settings) -> None:
    from worker.embedded import embedded_queues
    from worker.launcher import gpu_groups
    from worker.task import _queue_ranks

    assert embedded_queues(settings) == [settings.default_queue]
    both = settings.model_copy(update={"cpu_ranks": True, "gpus_per_job": 2})
    assert embedded_queues(both) == [settings.default_queue, f"{settings.default_queue}-x2"]
    eight = [(i, "h200") for i in range(8)]
    assert [[i for i, _ in g] for g in gpu_groups(eight, 2, cpu_ranks=False)] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]
    assert [[i for i, _ in g] for g in gpu_groups(eight[:3], 2, cpu_ranks=False)] == [[0, 1]]
    assert gpu_groups(eight[:2], 1, cpu_ranks=False) == [[(0, "h200")], [(1, "h200")]]
    assert gpu_groups([(None, None)], 2, cpu_ranks=True) == [[(None, None)]]
    with pytest.raises(ValueError, match="has 1 GPU; give it 2 GPUs"):
        gpu_groups(eight[:1], 2, cpu_ranks=False)
    assert (_queue_ranks("gpu-default-x4"), _queue_ranks("gpu-default"), _queue_ranks(None)) == (4, 1, 1)


def test_launcher_refuses_more_ranks_than_gpus() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZENFLOW_")}
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "--gpus", "none", "--gpus-per-job", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT), "ZENFLOW_CPU_RANKS": "false"},
    )
    assert proc.returncode == 2 and "--gpus-per-job 2: this worker has no GPU" in proc.stderr, proc.stderr
    assert "ZENFLOW_CPU_RANKS=true" in proc.stderr


def test_rank_labels_and_peer_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.job.ranks import peer_lost
    from worker.metrics.telemetry import gpu_label

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert gpu_label() == "1"  # a CPU rank: its rank number
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert gpu_label() == "none"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert gpu_label() == "5"  # a GPU rank: its physical index

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:42406")
    assert (
        peer_lost(gloo)
        and not peer_lost(RuntimeError("CUDA out of memory"))
        and not peer_lost(ValueError("x"))
    )
    try:
        try:
            raise gloo
        except RuntimeError as e:
            raise RuntimeError("checkpoint 10 failed on rank 0") from e
    except RuntimeError as wrapped:
        assert peer_lost(wrapped)


# --- a real 2-rank job ---------------------------------------------------------------------------


class Worker:
    """``python -m worker --gpus none --gpus-per-job 2`` (gloo CPU ranks) on a private queue."""

    def __init__(self, settings: Settings, redis_url: str, queue: str, tmp_path: Path) -> None:
        self.settings, self.queue, self.log = settings, queue, tmp_path / "worker.log"
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "ZENFLOW_BROKER_URL": redis_url,
            "ZENFLOW_DATABASE_URL": settings.resolved_database_url,
            "ZENFLOW_DATA_DIR": str(settings.data_dir),
            "ZENFLOW_DEFAULT_QUEUE": queue,
            "ZENFLOW_CPU_RANKS": "true",
            "ZENFLOW_HEARTBEAT_INTERVAL_SECONDS": "1",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "TOKENIZERS_PARALLELISM": "false",
            # the session database holds other tests' queued jobs: not for this Redis
            "ZENFLOW_DISPATCH_GRACE_SECONDS": "86400",
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable,
            "-m",
            "worker",
            "--gpus",
            "none",
            "--gpus-per-job",
            "2",
            "--queues",
            self.queue,
            "--loglevel",
            "INFO",
        ]
        with self.log.open("ab") as f:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        return self.proc

    def enqueue(self, job_id: str, queue: str) -> None:
        from worker.broker import configure_celery, enqueue_job

        configure_celery(self.settings.model_copy(update={"broker_url": self.env["ZENFLOW_BROKER_URL"]}))
        try:
            enqueue_job(job_id, queue=queue)
        finally:
            configure_celery()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def worker(settings: Settings, redis_broker_url: str, unique_queue: str, tmp_path: Path) -> Iterator[Worker]:
    w = Worker(settings, redis_broker_url, unique_queue, tmp_path)
    yield w
    w.stop()


STEPS, EVERY = 40, 10


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rank_killed_mid_job_requeues_and_resumes_once(worker: Worker, tmp_path: Path) -> None:
    """SIGKILL rank 1 after the first checkpoint: the group ends (rank 0 too, no runner left), the job
    is re-queued with the attempt counted, resumes on 2 ranks from its checkpoint and succeeds once;
    its final model loads with from_pretrained."""
    from transformers import AutoModelForCausalLM

    from worker.broker import queue_for_gpus

    url = worker.settings.resolved_database_url
    queue = queue_for_gpus(2, worker.queue)
    job_id = make_job(
        url,
        sums_file(tmp_path / "d.jsonl", n=64),
        queue=queue,
        gpus=2,
        hyperparameters={"batch_size": 2, "n_epochs": 2, "max_steps": STEPS, "checkpoint_every": EVERY},
        engine={"mode": "zenflow", "update_interval": 2, "select_interval": 4},
    )
    worker.start()
    worker.enqueue(job_id, queue)

    def past_checkpoint() -> bool:
        j = get_job(url, job_id)
        return j.status == "running" and j.last_checkpoint_path is not None and j.global_step >= EVERY + 2

    wait_for(past_checkpoint, 400, "a checkpoint and a few more steps", log=worker.log)
    ranks = wait_for(lambda: (r := rank_pids(job_id)) and len(r) == 2 and r, 20, "both ranks", log=worker.log)
    first = get_job(url, job_id)
    assert first.attempts == 1 and first.worker_hostname and first.worker_hostname.startswith("cpu@")
    os.kill(ranks[1], signal.SIGKILL)  # e.g. the OOM killer takes one rank
    wait_for(lambda: not alive(ranks[0]) and not alive(ranks[1]), 60, "the group to end", log=worker.log)

    job = wait_for(
        lambda: (j := get_job(url, job_id)).status in ("succeeded", "failed", "cancelled") and j,
        600,
        "the resumed job to end",
        log=worker.log,
        interval=0.5,
    )
    msgs = messages(url, job_id)
    assert job.status == "succeeded", (job.error, msgs[-10:])
    assert job.attempts == 2 and job.global_step == STEPS
    assert any("killed by SIGKILL" in m and "re-queued to resume" in m for m in msgs), msgs
    resumed = [m for m in msgs if m.startswith("Training resumed at step")]
    assert len(resumed) == 1 and int(re.search(r"step (\d+)", resumed[0]).group(1)) % EVERY == 0, resumed  # type: ignore[union-attr]
    assert sum(m.startswith("Job succeeded") for m in msgs) == 1
    assert sum(m.startswith("Attempt ") for m in msgs) == 2
    with session_scope(url) as s:
        steps = list(
            s.scalars(
                select(JobStepMetric.step).where(JobStepMetric.job_id == job_id).order_by(JobStepMetric.step)
            )
        )
        runs = list(s.scalars(select(JobRun.gpus).where(JobRun.job_id == job_id)))
        final = s.get(RegisteredModel, job.fine_tuned_model)
        assert final is not None
        final_path = Path(final.path)
    assert steps == list(range(1, STEPS + 1)) and runs == [2, 2]
    AutoModelForCausalLM.from_pretrained(final_path, local_files_only=True)
    wait_for(lambda: not rank_pids(job_id), 30, "the second run's ranks to exit", log=worker.log)
    assert worker.proc is not None and worker.proc.poll() is None  # the worker itself lives on
    assert "rank 1 of 2 exited (killed by SIGKILL" in worker.log.read_text(errors="replace")
    with session_scope(url) as s:  # registered for admission as a worker of 2-rank jobs
        row = wait_for(
            lambda: s.get(WorkerRow, str(job.worker_hostname), populate_existing=True),
            60,
            "the worker's registry row",
            log=worker.log,
        )
        assert (row.gpus_per_job, row.queues) == (2, [queue])


def test_a_multi_gpu_worker_reads_every_gpu_of_its_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's NVML series: one per GPU of its group, under the ``gpu`` label each rank uses."""
    from prometheus_client import CollectorRegistry

    from worker.metrics import nvml
    from worker.metrics.server import hardware_collectors

    class Fake(nvml.Nvml):
        def available(self) -> bool:
            return True

        def index_of_uuid(self, uuid: str) -> int | None:
            return 7 if uuid == "GPU-seven" else None

        def uuid(self, index: int) -> str | None:
            return f"GPU-{index}"

        def sample(self, index: int) -> tuple[float, int, int]:
            return (index / 10, index, 100)

    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-seven")
    reg = CollectorRegistry()
    for c in hardware_collectors("w", None, "h", Fake()):
        reg.register(c)
    util = {
        s.labels["gpu"]: s.value
        for m in reg.collect()
        for s in m.samples
        if s.name == "zenflow_nvml_gpu_utilization_ratio"
    }
    assert util == {"2": pytest.approx(0.2), "7": pytest.approx(0.7)}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    assert [c.gpu for c in hardware_collectors("w", None, "h", Fake())] == ["4"]
    assert [c.gpu for c in hardware_collectors("w", "9", "h", Fake())] == ["9"]

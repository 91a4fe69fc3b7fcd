"""One job on two worker hosts (issue 24, part 2): two real Celery workers on this machine act as two
nodes (their own node names, the rendezvous on the loopback, the job's output on the shared data dir),
gang-scheduled through the database (store.gang, worker.gang): the 2-node x 1-rank job equals the same
job on 1 node x 2 ranks; a gang that cannot form releases its slot and the job keeps its place; a node's
worker killed mid-job re-queues the job once and it resumes and succeeds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sqlalchemy import select

from store import jobs
from store.db import session_scope
from store.fairshare import fair_order
from store.orm import JobNode, JobRun, JobStatus
from store.settings import Settings
from tests.worker.claims import claim_job
from tests.worker.test_multi_rank_job import alive, messages, rank_pids, wait_for
from tests.worker.test_worker import get_job, make_job, sums_file

ROOT = Path(__file__).resolve().parents[2]
HP = {"batch_size": 2, "n_epochs": 1, "max_steps": 8, "checkpoint_every": 4}
TERMINAL = ("succeeded", "failed", "cancelled")


class Node:
    """``python -m worker --gpus none`` (one gloo CPU rank per job) named ``cpu@<name>`` on a private
    queue, its rendezvous on 127.0.0.1."""

    def __init__(self, settings: Settings, redis_url: str, queue: str, name: str, tmp_path: Path) -> None:
        self.settings, self.queue, self.name = settings, queue, name
        self.log = tmp_path / f"{name}.log"
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "ZENFLOW_BROKER_URL": redis_url,
            "ZENFLOW_DATABASE_URL": settings.resolved_database_url,
            "ZENFLOW_DATA_DIR": str(settings.data_dir),  # the shared storage: job outputs, checkpoints
            "ZENFLOW_DEFAULT_QUEUE": queue,
            "ZENFLOW_WORKER_NAME": name,
            "ZENFLOW_WORKER_ADDRESS": "127.0.0.1",
            "ZENFLOW_HEARTBEAT_INTERVAL_SECONDS": "1",
            "ZENFLOW_HEARTBEAT_TIMEOUT_SECONDS": "15",
            "ZENFLOW_GANG_FORM_TIMEOUT_SECONDS": "20",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "TOKENIZERS_PARALLELISM": "false",
            "ZENFLOW_DISPATCH_GRACE_SECONDS": "86400",  # the session database holds other tests' jobs
        }
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def hostname(self) -> str:
        return f"cpu@{self.name}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "worker", "--gpus", "none", "--queues", self.queue, "--loglevel", "INFO"]
        with self.log.open("ab") as f:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)

    def enqueue(self, job_id: str) -> None:
        from worker.broker import configure_celery, enqueue_job

        configure_celery(self.settings.model_copy(update={"broker_url": self.env["ZENFLOW_BROKER_URL"]}))
        try:
            enqueue_job(job_id, queue=self.queue)
        finally:
            configure_celery()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def settings(service_env: dict[str, str]) -> Settings:
    from store.settings import get_settings

    return get_settings()


@pytest.fixture
def nodes(
    settings: Settings, redis_broker_url: str, unique_queue: str, tmp_path: Path
) -> Iterator[list[Node]]:
    pair = [Node(settings, redis_broker_url, unique_queue, name, tmp_path) for name in ("node-a", "node-b")]
    yield pair
    for n in pair:
        n.stop()


def _final(job_id: str, url: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = Path(get_job(url, job_id).output_dir or "")
    return load_file(str(out / "final" / "model.safetensors"))


def _ended(url: str, job_id: str, timeout: float, log: Path) -> object:
    return wait_for(
        lambda: (j := get_job(url, job_id)).status in TERMINAL and j,
        timeout,
        "the job to end",
        log=log,
        interval=0.5,
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_two_node_job_equals_one_node_of_two_ranks(
    nodes: list[Node], settings: Settings, tmp_path: Path
) -> None:
    from worker.task import run_child

    url = settings.resolved_database_url
    data = sums_file(tmp_path / "d.jsonl", n=32)
    gang_job = make_job(
        url, data, queue=nodes[0].queue, hyperparameters=HP, resources={"nodes": 2, "gpus": 1}
    )
    for n in nodes:
        n.start()
    nodes[0].enqueue(gang_job)
    job = get_job(url, gang_job)
    job = _ended(url, gang_job, 600, nodes[0].log)  # type: ignore[assignment]
    msgs = messages(url, gang_job)
    assert job.status == "succeeded", (job.error, msgs[-10:], nodes[1].log.read_text()[-3000:])
    assert job.attempts == 1 and job.worker_hostname in {n.hostname for n in nodes}
    assert any(m.startswith("Gang of 2 nodes formed") for m in msgs), msgs
    with session_scope(url) as s:
        members = {r.worker_hostname for r in s.scalars(select(JobNode).where(JobNode.job_id == gang_job))}
    assert members == {n.hostname for n in nodes}  # one node each
    for n in nodes:  # each node's task ends (node 1's ranks exit 0: nothing to settle)
        wait_for(lambda n=n: "ranks exited" in n.log.read_text(errors="replace"), 120, "its ranks", log=n.log)  # type: ignore[misc]
        n.stop()

    # the same job on one node of two ranks, run the way a worker runs it
    ref = make_job(url, data, queue="ref-" + nodes[0].queue, hyperparameters=HP, resources={"gpus": 2})
    assert claim_job(ref, "cpu@reference", settings) == "claimed"
    assert run_child(ref, "cpu@reference", settings, ranks=2) == 0
    assert get_job(url, ref).status == "succeeded", messages(url, ref)[-5:]
    a, b = _final(ref, url), _final(gang_job, url)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k].float(), a[k].float(), rtol=0, atol=1e-5, msg=k)


def _events(url: str, job_id: str) -> list[str]:
    return messages(url, job_id)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_gang_that_cannot_form_releases_its_slot_and_the_job_keeps_its_place(
    nodes: list[Node], settings: Settings, tmp_path: Path
) -> None:
    url = settings.resolved_database_url
    data = sums_file(tmp_path / "d.jsonl", n=32)
    queue = nodes[0].queue
    big = make_job(url, data, queue=queue, hyperparameters=HP, resources={"nodes": 2, "gpus": 1})
    later = make_job(url, data, queue=queue, hyperparameters=HP, status="validating_files")  # waits behind
    created = get_job(url, big).created_at
    nodes[0].env["ZENFLOW_GANG_FORM_TIMEOUT_SECONDS"] = "4"  # nothing to wait for: no second node comes
    nodes[0].start()  # one node only: the gang cannot form
    nodes[0].enqueue(big)
    wait_for(
        lambda: any(m.startswith("Gang released") for m in _events(url, big)),
        120,
        "the release",
        log=nodes[0].log,
    )
    job = get_job(url, big)
    assert (job.status, job.attempts, job.created_at) == ("queued", 0, created)  # nothing counted
    with session_scope(url) as s:
        assert s.scalars(select(JobRun).where(JobRun.job_id == big)).all() == []  # no GPU time held
        order = fair_order(queue)
        assert list(s.scalars(select(order.c.job_id).order_by(order.c.pos))) == [big, later]
    assert "did not form within 4 s; released" in nodes[0].log.read_text(errors="replace")
    nodes[0].stop()
    with session_scope(url) as s:  # nothing of this test left for the session's other claims
        for job_id in (big, later):
            j = jobs.lock_job(s, job_id)
            if j is not None and not JobStatus(j.status).terminal:
                jobs.cancel(s, j, "test over")


STEPS, EVERY = 40, 5


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_node_killed_mid_job_requeues_once_and_the_job_resumes(
    nodes: list[Node], settings: Settings, tmp_path: Path
) -> None:
    url = settings.resolved_database_url
    hp = {**HP, "n_epochs": 3, "max_steps": STEPS, "checkpoint_every": EVERY}
    job_id = make_job(
        url,
        sums_file(tmp_path / "d.jsonl", n=32),
        queue=nodes[0].queue,
        hyperparameters=hp,
        resources={"nodes": 2, "gpus": 1},
    )
    for n in nodes:
        n.start()
    nodes[0].enqueue(job_id)

    def past_checkpoint() -> bool:
        j = get_job(url, job_id)
        return j.status == "running" and j.last_checkpoint_path is not None and j.global_step >= EVERY + 1

    wait_for(past_checkpoint, 400, "a checkpoint and a step more", log=nodes[1].log)
    first = get_job(url, job_id)
    member = next(n for n in nodes if n.hostname != first.worker_hostname)  # not the rendezvous host
    ranks = rank_pids(job_id)
    member.kill()  # the worker of one node dies (its agent and rank with it)
    wait_for(lambda: not any(alive(p) for p in ranks.values()), 60, "every rank to end", log=nodes[0].log)
    member.start()  # a node comes back: the job forms a new gang and resumes
    job = _ended(url, job_id, 600, member.log)
    msgs = messages(url, job_id)
    assert job.status == "succeeded", (job.error, msgs[-10:])  # type: ignore[attr-defined]
    assert job.attempts == 2 and job.global_step == STEPS  # type: ignore[attr-defined]
    assert sum("re-queued" in m for m in msgs) == 1, msgs
    assert sum(m.startswith("Gang of 2 nodes formed") for m in msgs) == 2, msgs
    resumed = [m for m in msgs if m.startswith("Training resumed at step")]
    assert len(resumed) == 1, msgs
    assert sum(m.startswith("Job succeeded") for m in msgs) == 1

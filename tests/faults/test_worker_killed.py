"""A worker killed with SIGKILL mid-job: the job resumes from its last checkpoint on another worker and
succeeds, and it never runs twice.

What the design promises (worker/task.py, worker/reaper.py): the database is the source of truth;
the training subprocess dies with its worker (PR_SET_PDEATHSIG); the job row stays ``running`` while
its heartbeat ages; a live worker's reaper re-queues it after ``heartbeat_timeout_seconds`` (attempts
counted; the stack derives the timeout from how slow the machine is now, tests.support.heartbeat_timeout,
so that the replacement's own live run is never taken for dead on a loaded machine); the next run
resumes from the newest complete checkpoint; a redelivered broker message for a job that is running
elsewhere (fresh heartbeat) or already terminal is dropped. The broker's visibility timeout is cut to
5 s here so that the killed worker's unacknowledged message really is redelivered while the job runs
again: two replacement workers compete for the messages, and exactly one run happens.
"""

from __future__ import annotations

import re
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.faults.harness import Client, job_params, stack, wait_until

pytestmark = [pytest.mark.services, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, EVERY = 240, 40


def _runner_pids(job_id: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"worker.job.runner" in cmd and job_id.encode() in cmd:
                pids.append(int(d.name))
    return pids


def test_sigkill_mid_job_resumes_from_checkpoint_without_duplicate_run(tmp_path: Path) -> None:
    with stack(tmp_path, prefix="zf_kill", ZENFLOW_BROKER_VISIBILITY_TIMEOUT_SECONDS="5") as st:
        api = st.start_api()
        a = st.start_worker("killed")
        _, key = st.create_team_key()
        c = Client(api, key)
        job_id = c.create_job(c.upload(), **job_params(STEPS, checkpoint_every=EVERY))
        created_at = time.monotonic()

        # let it run past its first checkpoint, then kill the worker outright
        def past_checkpoint() -> bool:
            j = st.job(job_id)
            return j.status == "running" and j.last_checkpoint_path is not None and j.global_step >= EVERY + 5

        wait_until(past_checkpoint, 240, "a checkpoint and a few more steps", interval=0.05)
        first_run = time.monotonic() - created_at  # a runner's start-up and EVERY + 5 steps, on this box now
        assert _runner_pids(job_id), "the training subprocess runs"
        a.kill(signal.SIGKILL)
        killed_at = time.monotonic()
        a.popen.wait(10)
        wait_until(lambda: not _runner_pids(job_id), 10, "the training subprocess to die with its worker")
        before = st.job(job_id)
        assert before.status == "running" and before.attempts == 1  # nobody has told the database yet
        ckpt_step = max(ck.step_number for ck in _checkpoints(st, job_id))
        last_step_first_run = before.global_step
        assert last_step_first_run < STEPS

        # two replacement workers: one re-queues (reaper) and runs it, redelivered messages are dropped
        b = st.start_worker("spare-b")
        cw = st.start_worker("spare-c")
        # the reaper's round after the timeout, a start-up and the STEPS - EVERY steps left (< 5 first runs)
        job = st.wait_status(
            job_id, {"succeeded", "failed", "cancelled"}, max(400.0, 2 * st.heartbeat_timeout + 8 * first_run)
        )
        assert job.status == "succeeded", st.logs()
        # re-queued only once the heartbeat went stale (its last beat at most an interval before the kill)
        assert time.monotonic() - killed_at > st.heartbeat_timeout - st.heartbeat_interval
        assert job.attempts == 2, f"attempts {job.attempts}: {[e.message for e in st.events(job_id)]}"
        assert job.global_step == STEPS and job.fine_tuned_model

        msgs = [e.message for e in st.events(job_id)]
        assert sum(m.startswith("Training started") for m in msgs) == 1, msgs
        resumed = [m for m in msgs if m.startswith("Training resumed at step")]
        assert resumed == [resumed[0]] and int(re.search(r"step (\d+)", resumed[0]).group(1)) == ckpt_step, (
            resumed
        )
        assert sum(m.startswith("Attempt ") for m in msgs) == 2, [m for m in msgs if m.startswith("Attempt")]

        # one metrics event per step: the steps the second run replays (from the checkpoint up to where
        # the first run got) keep the first run's event; none ran concurrently
        steps = Counter(
            int(e.data["step"])
            for e in st.events(job_id)
            if e.type == "metrics" and e.data and "train_loss" in e.data
        )
        assert set(steps) == set(range(1, STEPS + 1))
        assert all(steps[s] == 1 for s in steps), {s: n for s, n in steps.items() if n != 1}
        evs = st.events(job_id)
        second = next(e.seq for e in evs if e.message.startswith("Attempt 2"))
        late = [
            int(e.data["step"])
            for e in evs
            if e.seq > second and e.type == "metrics" and e.data and "train_loss" in e.data
        ]
        assert late == list(range(max(ckpt_step, last_step_first_run) + 1, STEPS + 1)), (
            "the second run trains on from the checkpoint, alone"
        )
        assert len(st.step_metrics(job_id)) == STEPS

        # exactly one replacement worker ran it; the other dropped what it was handed
        ran = [w for w in (b, cw) if re.search(rf"job {job_id}: running on", w.tail(200000))]
        assert len(ran) == 1, st.logs()
        # no runner process is left
        wait_until(lambda: not _runner_pids(job_id), 30, "the runner to exit")
        assert not [p for p in (b, cw) if not p.alive()]


def _checkpoints(st, job_id):
    from sqlalchemy import select

    from store.orm import JobCheckpoint

    with st.session() as s:
        return list(s.scalars(select(JobCheckpoint).where(JobCheckpoint.job_id == job_id)))

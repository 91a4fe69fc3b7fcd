"""Disk full while checkpointing: the job stops with the reason, keeps its previous checkpoint, and is
re-queued at once without counting an attempt, to wait off the GPU (its run ended: the wait is not
billed); with space back it resumes and succeeds.

A real small filesystem, not a mock: the jobs directory is a tmpfs mounted for the test (we run as
root, as CI does; without the privilege to mount the test skips and says so). Once the job's first
checkpoint is on disk the rest of the filesystem is filled, so the next checkpoint write hits ENOSPC
for real. Then: the job says "no space left while writing checkpoint N", the partial checkpoint
directory is gone, the earlier checkpoint is byte-for-byte what it was and still complete (and so
resumable), and the worker re-queues the job at once, the attempt not counted, its events naming the
checkpoint it resumes from; no run of the job overlaps its waits. Once space is back the job resumes
from that checkpoint and succeeds. (The bound on such re-queues in a row, and a job with no checkpoint
yet, are tests/worker/test_job_disk_full.py.)
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import os
import re
import subprocess
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from store.orm import JobRun, as_utc
from tests.faults.harness import Client, job_params, stack, wait_until
from tests.support import unavailable

pytestmark = [pytest.mark.services, pytest.mark.slow, pytest.mark.timeout(600)]

SIZE_MB = 48


@contextlib.contextmanager
def small_filesystem(path: Path, size_mb: int):
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        unavailable("mounting a small tmpfs needs root (CI runs as root)")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        unavailable(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path) -> Path:
    """Write until the filesystem says ENOSPC (big writes, then small ones for the last blocks)."""
    filler = path / f"filler-{uuid.uuid4().hex[:6]}"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for size in (1 << 20, 1 << 12, 1):
            chunk = b"\0" * size
            try:
                while True:
                    os.write(fd, chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    assert os.statvfs(path).f_bavail == 0
    return filler


def digest(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def test_disk_full_while_checkpointing(tmp_path: Path) -> None:
    from trainer.run.checkpoint import is_complete, list_checkpoints, load_training_state

    with (
        small_filesystem(tmp_path / "jobs", SIZE_MB) as jobs_dir,
        stack(
            tmp_path,
            prefix="zf_disk",
            ZENFLOW_JOBS_DIR=str(jobs_dir),
            ZENFLOW_DISK_FULL_BACKOFF_SECONDS="3",
            ZENFLOW_DISK_FULL_MAX_REQUEUES="5",
        ) as st,
    ):
        api = st.start_api()
        st.start_worker("disk")
        _, key = st.create_team_key()
        c = Client(api, key)
        fid = c.upload()
        job_id = c.create_job(fid, **job_params(300, checkpoint_every=60))
        out = jobs_dir / job_id

        first = wait_until(lambda: list_checkpoints(out), 240, "the first checkpoint on disk", interval=0.02)[
            0
        ]
        filler = fill(jobs_dir)
        # the job may have completed another checkpoint since the poll saw the first: what it keeps is
        # the newest complete one as the disk filled, named by its message below
        before = {ck.path.name: digest(ck.path) for ck in list_checkpoints(out)}
        assert st.job(job_id).status == "running"

        def waiting() -> list[Any]:
            return [e for e in st.events(job_id) if "off the GPU before it runs again" in e.message]

        held = wait_until(waiting, 300, "the disk-full re-queue", interval=0.2)[0]
        assert held.message.startswith("No space left while writing checkpoint ")
        assert "(disk-full re-queue 1/5; attempts are not counted)" in held.message
        said = re.search(r"the previous checkpoint (checkpoint-\d+) \(step (\d+)\) is kept", held.message)
        assert said, held.message
        kept = next(ck for ck in list_checkpoints(out) if ck.path.name == said[1])
        assert kept.step == int(said[2]) >= first.step
        step = int(held.message.split()[6].rstrip(";"))
        assert step > kept.step
        # queued at once, in the same transaction: not held running while it waits
        events = st.events(job_id)
        requeued = events[[e.id for e in events].index(held.id) + 1]
        assert requeued.message == (
            f"No space left while writing checkpoint {step} (disk-full re-queue 1/5); re-queued to resume "
            f"from step {kept.step}"
        )
        assert requeued.data["status"] == "queued"
        job = st.job(job_id)
        assert job.status in ("queued", "running") and job.error is None and job.attempts <= 1
        warning = [
            e for e in st.events(job_id) if e.message == f"no space left while writing checkpoint {step}"
        ]
        assert len(warning) == 1 and warning[0].level == "warning", [e.message for e in st.events(job_id)][
            -8:
        ]

        # the previous checkpoint is intact and still resumable; no half-written one is left
        assert kept.path.is_dir() and is_complete(kept.path)
        assert digest(kept.path) == before[kept.path.name]
        assert [ck.step for ck in list_checkpoints(out)][-1] == kept.step
        assert not [p.name for p in out.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
        assert load_training_state(kept.path) is not None
        assert job.last_checkpoint_path and Path(job.last_checkpoint_path).name == kept.path.name

        # space back: the job resumes from that checkpoint and succeeds, its attempt never counted
        filler.unlink()
        job = st.wait_status(job_id, {"failed", "succeeded", "cancelled"}, 300)
        msgs = [e.message for e in st.events(job_id)]
        assert job.status == "succeeded", (job.status, job.error, msgs[-8:])
        assert job.attempts == 1 and job.error is None
        assert f"Training resumed at step {kept.step}" in " | ".join(msgs)
        # the GPU-seconds billed: the runs only, none of the waits between them
        with st.session() as s:
            runs = s.scalars(select(JobRun).where(JobRun.job_id == job_id).order_by(JobRun.started_at)).all()
            spans = [(as_utc(r.started_at), as_utc(r.ended_at), r.gpu_seconds) for r in runs]
        assert len(spans) >= 2 and all(end is not None for _, end, _ in spans)
        assert spans[0][1] <= as_utc(requeued.created_at)  # the first run ended at its re-queue
        for (_, end, _), (start, _, _) in itertools.pairwise(spans):
            assert start >= end + timedelta(seconds=3)  # the wait (3 s, then doubled) is no run
        for start, end, billed in spans:
            assert billed == pytest.approx((end - start).total_seconds())
        assert not [m for m in msgs if "inline_container" in m or "enforce fail" in m]

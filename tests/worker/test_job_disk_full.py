"""A job stopped by a full disk (issue 16, item 5's job half), against the real PostgreSQL.

The checkpoint writer on a filesystem that fills up (a real small tmpfs: root only) says "no space left
while writing checkpoint N", removes its partial directory and keeps the previous checkpoint; the
worker's policy after such an exit (exit 74) re-queues the job after a backoff without counting an
attempt, and fails it after too many such re-queues in a row. The whole flow through the API and a
worker is tests/faults/test_disk_full.py.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from store.db import session_scope
from store.jobs import add_event
from store.orm import FineTuningJob
from store.settings import Settings
from tests.faults.test_disk_full import digest, fill, small_filesystem
from tests.worker.claims import claim_job
from tests.worker.test_worker import get_job, make_job, messages, sums_file


@pytest.fixture
def settings(service_env: dict[str, str]) -> Iterator[Settings]:
    from store.settings import get_settings

    yield get_settings().model_copy(
        update={
            "disk_full_backoff_seconds": 0.3,
            "disk_full_max_requeues": 2,
            "heartbeat_interval_seconds": 0.1,
        }
    )


def _runner_hit_a_full_disk(url: str, job_id: str, checkpoint: str, step: int) -> None:
    """What a runner leaves behind when a checkpoint write finds no space: claimed, its newest checkpoint
    the one kept, and the reporter's warning (see worker.job.reporter)."""

    settings = Settings(database_url=url)
    assert claim_job(job_id, "w1@h", settings) == "claimed"
    message = f"no space left while writing checkpoint {step}"
    with session_scope(url) as s:
        job = s.get(FineTuningJob, job_id)
        assert job is not None
        job.last_checkpoint_path, job.global_step = checkpoint, step
        add_event(
            s, job_id, message, level="warning", data={"error_type": "DiskFullError", "disk_full": message}
        )


def test_disk_full_requeues_after_a_backoff_without_counting_attempts(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker.task as w
    from worker.job.exits import EXIT_DISK_FULL

    sent: list[str] = []
    monkeypatch.setattr(w, "enqueue_job", lambda job_id, queue=None: sent.append(job_id))
    url = settings.resolved_database_url
    job_id = make_job(url, sums_file(tmp_path / "d.jsonl"))
    for n, backoff in ((1, 0.3), (2, 0.6)):  # the disk stays full: the same checkpoint each time
        _runner_hit_a_full_disk(url, job_id, "/jobs/x/checkpoint-000060", 120)
        t0 = time.monotonic()
        assert w.finish_after_exit(job_id, EXIT_DISK_FULL, "w1@h", settings) == "requeued"
        assert time.monotonic() - t0 >= backoff  # held for the backoff before the re-queue
        job = get_job(url, job_id)
        assert (job.status, job.attempts, job.error, sent[-1]) == ("queued", 0, None, job_id)
        msgs = messages(url, job_id)
        assert (
            f"No space left while writing checkpoint 120; the previous checkpoint is kept. Retrying in {backoff:g} s "
            f"(disk-full re-queue {n}/2; attempts are not counted)"
        ) in msgs
        assert msgs[-1].startswith(
            f"No space left while writing checkpoint 120 (disk-full re-queue {n}/2); re-queued"
        )
    _runner_hit_a_full_disk(url, job_id, "/jobs/x/checkpoint-000060", 120)
    assert w.finish_after_exit(job_id, EXIT_DISK_FULL, "w1@h", settings) == "failed"
    job = get_job(url, job_id)
    assert job.status == "failed" and job.error is not None and job.error["code"] == "disk_full"
    assert job.error["message"].startswith(
        "no space left while writing checkpoint 120; gave up after 2 re-queues"
    )
    assert len(sent) == 2

    # a new checkpoint in between: the disk was freed for a while, so the count starts again
    other = make_job(url, sums_file(tmp_path / "e.jsonl"))
    for ckpt in ("/jobs/y/checkpoint-000060", "/jobs/y/checkpoint-000120", "/jobs/y/checkpoint-000180"):
        _runner_hit_a_full_disk(url, other, ckpt, 200)
        assert w.finish_after_exit(other, EXIT_DISK_FULL, "w1@h", settings) == "requeued"
        assert "(disk-full re-queue 1/2)" in messages(url, other)[-1]


def test_disk_full_backoff_honours_a_cancel(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker.task as w
    from worker.job.exits import EXIT_DISK_FULL

    monkeypatch.setattr(
        w, "enqueue_job", lambda job_id, queue=None: pytest.fail("a cancelled job is not re-queued")
    )
    settings = settings.model_copy(update={"disk_full_backoff_seconds": 60.0})
    url = settings.resolved_database_url
    job_id = make_job(url, sums_file(tmp_path / "d.jsonl"))
    _runner_hit_a_full_disk(url, job_id, "/jobs/z/checkpoint-000010", 20)

    def cancel() -> None:
        time.sleep(0.5)
        with session_scope(url) as s:
            s.get(FineTuningJob, job_id).cancel_requested = True  # type: ignore[union-attr]

    threading.Thread(target=cancel, daemon=True).start()
    t0 = time.monotonic()
    assert w.finish_after_exit(job_id, EXIT_DISK_FULL, "w1@h", settings) == "cancelled"
    assert time.monotonic() - t0 < 30
    assert get_job(url, job_id).status == "cancelled"


def test_checkpoint_write_on_a_full_disk(tmp_path: Path) -> None:
    """A real full filesystem: the error names the checkpoint, the partial directory is gone and the
    previous checkpoint is what it was."""
    from trainer.run.checkpoint import DiskFullError, is_complete, write_atomic_dir

    def payload(size: int) -> Callable[[Path], None]:
        def write(d: Path) -> None:
            import torch

            torch.save({"w": torch.zeros(size // 4)}, d / "training_state.pt")  # torch's ENOSPC has no errno

        return write

    with small_filesystem(tmp_path / "fs", 8) as fs:
        first = write_atomic_dir(fs / "checkpoint-000010", payload(1 << 20), {"step": 10})
        before = digest(first)
        filler = fill(fs)
        filler.unlink()
        with (fs / "keep").open("wb") as f:  # leave about 1.5 MiB free
            f.write(b"\0" * (os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize - (3 << 19)))
        with pytest.raises(DiskFullError) as err:
            write_atomic_dir(fs / "checkpoint-000020", payload(4 << 20), {"step": 20})
        assert (
            str(err.value) == "no space left while writing checkpoint 20" and err.value.errno == errno.ENOSPC
        )
        assert is_complete(first) and digest(first) == before
        assert sorted(p.name for p in fs.iterdir()) == ["checkpoint-000010", "keep"]

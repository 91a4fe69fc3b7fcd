"""A job stopped by a full disk (issue 16, item 5's job half; issue 25, item 7), against the real
PostgreSQL.

The checkpoint writer on a filesystem that fills up (a real small tmpfs: root only) says "no space left
while writing checkpoint N", removes its partial directory and keeps the previous checkpoint; the
worker's policy after such an exit (exit 74) ends the run and re-queues the job at once, the attempt
not counted, to wait off the GPU (``not_before``: not claimed, not dispatched) for a backoff that
doubles in a row; too many such re-queues in a row fail it. Its events say which checkpoint it resumes
from, or that none exists. The whole flow through the API and a worker is
tests/faults/test_disk_full.py.
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from store.db import session_scope
from store.jobs import add_event, cancel, lock_job
from store.orm import FineTuningJob, JobRun, as_utc, utcnow
from store.settings import Settings
from tests.faults.test_disk_full import digest, fill, small_filesystem
from tests.worker.claims import claim_job
from tests.worker.test_worker import get_job, make_job, messages, sums_file

#: The first wait off the GPU (doubled for each disk-full re-queue in a row).
BACKOFF = 1.0


@pytest.fixture
def settings(service_env: dict[str, str]) -> Iterator[Settings]:
    from store.settings import get_settings

    yield get_settings().model_copy(
        update={
            "disk_full_backoff_seconds": BACKOFF,
            "disk_full_max_requeues": 2,
            "heartbeat_interval_seconds": 0.1,
        }
    )


def _runner_hit_a_full_disk(url: str, job_id: str, checkpoint: str | None, step: int) -> None:
    """What a runner leaves behind when a checkpoint write finds no space: claimed, its newest checkpoint
    the one kept (None: none yet), and the reporter's warning (see worker.job.reporter)."""

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


def _runs(url: str, job_id: str) -> list[JobRun]:
    with session_scope(url) as s:
        runs = list(s.scalars(select(JobRun).where(JobRun.job_id == job_id).order_by(JobRun.started_at)))
        s.expunge_all()
        return runs


def _event_data(url: str, job_id: str, key: str) -> dict[str, Any]:
    """The data of the job's newest event that carries ``key``."""
    from store.orm import JobEvent

    with session_scope(url) as s:
        for data in s.scalars(
            select(JobEvent.data).where(JobEvent.job_id == job_id).order_by(JobEvent.seq.desc())
        ):
            if isinstance(data, dict) and key in data:
                return data
    raise AssertionError(f"no event of job {job_id} carries {key!r}")


def test_disk_full_requeues_at_once_to_wait_off_the_gpu(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker.task as w
    from worker.job.exits import EXIT_DISK_FULL

    sent: list[str] = []
    monkeypatch.setattr(w, "enqueue_job", lambda job_id, queue=None: sent.append(job_id))
    url = settings.resolved_database_url
    job_id = make_job(url, sums_file(tmp_path / "d.jsonl"))
    for n, backoff in ((1, BACKOFF), (2, 2 * BACKOFF)):  # the disk stays full: the same checkpoint each time
        _runner_hit_a_full_disk(url, job_id, "/jobs/x/checkpoint-000060", 120)
        assert w.finish_after_exit(job_id, EXIT_DISK_FULL, "w1@h", settings) == "requeued"
        settled = utcnow()
        job = get_job(url, job_id)  # queued at once, its attempt given back; no message yet
        assert (job.status, job.attempts, job.error, job.worker_hostname) == ("queued", 0, None, None)
        assert not sent and job.dispatched_at is None
        run = _runs(url, job_id)[-1]  # the run ended with the runner, the wait is none of it
        ended, not_before = as_utc(run.ended_at), as_utc(job.not_before)
        assert ended is not None and not_before is not None and ended <= settled
        assert not_before - ended >= timedelta(seconds=backoff)
        assert run.gpu_seconds == pytest.approx((ended - as_utc(run.started_at)).total_seconds())  # type: ignore[operator]
        msgs = messages(url, job_id)
        assert msgs[-2] == (
            "No space left while writing checkpoint 120; the previous checkpoint checkpoint-000060 (step 60) "
            f"is kept. The job waits {backoff:g} s off the GPU before it runs again (disk-full re-queue "
            f"{n}/2; attempts are not counted)"
        )
        assert msgs[-1] == (
            f"No space left while writing checkpoint 120 (disk-full re-queue {n}/2); re-queued to resume "
            "from step 60"
        )
    _runner_hit_a_full_disk(url, job_id, "/jobs/x/checkpoint-000060", 120)
    assert w.finish_after_exit(job_id, EXIT_DISK_FULL, "w1@h", settings) == "failed"
    job = get_job(url, job_id)
    assert job.status == "failed" and job.error is not None and job.error["code"] == "disk_full"
    assert job.error["message"].startswith(
        "no space left while writing checkpoint 120; gave up after 2 re-queues"
    )
    assert not sent and all(r.ended_at is not None for r in _runs(url, job_id))

    # a new checkpoint in between: the disk was freed for a while, so the count starts again
    other = make_job(url, sums_file(tmp_path / "e.jsonl"))
    for ckpt in ("/jobs/y/checkpoint-000060", "/jobs/y/checkpoint-000120", "/jobs/y/checkpoint-000180"):
        _runner_hit_a_full_disk(url, other, ckpt, 200)
        assert w.finish_after_exit(other, EXIT_DISK_FULL, "w1@h", settings) == "requeued"
        assert "(disk-full re-queue 1/2)" in messages(url, other)[-1]

    # no checkpoint yet: said so, and where the job starts again (not global_step's "step 2")
    none = make_job(url, sums_file(tmp_path / "f.jsonl"))
    _runner_hit_a_full_disk(url, none, None, 2)
    assert w.finish_after_exit(none, EXIT_DISK_FULL, "w1@h", settings) == "requeued"
    msgs = messages(url, none)
    assert msgs[-2].startswith(
        "No space left while writing checkpoint 2; no checkpoint exists yet; the job will restart from "
        "step 0. The job waits"
    )
    assert msgs[-1].endswith("; re-queued to restart from step 0 (no checkpoint yet)")
    assert not [m for m in msgs if "previous checkpoint" in m or "resum" in m], msgs


def test_a_waiting_job_is_neither_claimed_nor_dispatched_before_its_time(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unique_queue: str
) -> None:
    import worker.task as w
    from worker.dispatch import HOLD_OVER_EVENT, dispatch_undispatched_jobs
    from worker.job.exits import EXIT_DISK_FULL

    monkeypatch.setattr(w, "enqueue_job", lambda job_id, queue=None: pytest.fail("dispatched by the task"))
    slow = settings.model_copy(update={"disk_full_backoff_seconds": 3600.0})
    url = slow.resolved_database_url
    job_id = make_job(url, sums_file(tmp_path / "d.jsonl"), queue=unique_queue)
    _runner_hit_a_full_disk(url, job_id, f"/jobs/{job_id}/checkpoint-000010", 20)
    assert w.finish_after_exit(job_id, EXIT_DISK_FULL, "w1@h", slow) == "requeued"
    not_before = as_utc(get_job(url, job_id).not_before)
    assert not_before is not None

    # a worker's message on its queue passes it over while it waits
    claimed = w.claim_next_job(job_id, "w2@h", slow, queue=unique_queue)
    assert (claimed.outcome.value, get_job(url, job_id).status) == ("idle", "queued")
    # the reaper's dispatcher sends its message only once the wait is over (not_before then cleared)
    sent: list[tuple[str, str]] = []

    def dispatch(now: Any) -> list[str]:
        got = dispatch_undispatched_jobs(settings=slow, now=now, enqueue=lambda j, q: sent.append((j, q)))
        return [j for j in got if j == job_id]

    assert dispatch(not_before - timedelta(seconds=1)) == []
    assert dispatch(not_before + timedelta(seconds=slow.dispatch_grace_seconds + 1)) == [job_id]
    job = get_job(url, job_id)
    assert [q for j, q in sent if j == job_id] == [unique_queue]
    assert job.dispatched_at is not None and job.not_before is None
    assert messages(url, job_id)[-1] == HOLD_OVER_EVENT
    claimed = w.claim_next_job(job_id, "w2@h", slow, queue=unique_queue)
    assert (claimed.outcome.value, claimed.job_id) == ("claimed", job_id)
    assert messages(url, job_id)[-1] == "Attempt 1/3 started on w2@h, resuming from step 10"

    # a cancel while it waits ends it at once (as for any queued job); nothing dispatches it then
    other = make_job(url, sums_file(tmp_path / "e.jsonl"), queue=unique_queue)
    _runner_hit_a_full_disk(url, other, None, 3)
    assert w.finish_after_exit(other, EXIT_DISK_FULL, "w1@h", slow) == "requeued"
    with session_scope(url) as s:
        cancel(s, lock_job(s, other), "Job cancelled")  # type: ignore[arg-type]
    assert get_job(url, other).status == "cancelled"
    assert w.claim_next_job(other, "w2@h", slow, queue=unique_queue).outcome.value == "idle"


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


# --- a real full disk under the in-process runner ------------------------------------------------------


@pytest.mark.parametrize("previous", [False, True], ids=["no-checkpoint-yet", "previous-checkpoint"])
def test_full_disk_at_a_checkpoint_frees_the_gpu_and_tells_the_truth(
    settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    unique_queue: str,
    previous: bool,
) -> None:
    """A job's checkpoint write hits a real full filesystem (a tmpfs filled up: before the run, or right
    after its first checkpoint): the runner exits 74, the job is queued again at once with its run
    ended (the wait off the GPU is no run: nothing of it billed), its events name the checkpoint it
    resumes from or say there is none, and once space is back it resumes from that step and succeeds.
    With a checkpoint on disk, a run claimed while the disk is still full stops before it trains."""
    import worker.job.reporter as reporter
    import worker.task as w
    from store.settings import get_settings
    from trainer.run.checkpoint import list_checkpoints
    from worker.dispatch import dispatch_undispatched_jobs
    from worker.job.exits import EXIT_DISK_FULL
    from worker.job.runner import HOSTNAME_ENV, run_job_process

    url = settings.resolved_database_url
    with small_filesystem(tmp_path / "jobs", 48) as jobs_dir:
        monkeypatch.setenv("ZENFLOW_JOBS_DIR", str(jobs_dir))
        monkeypatch.setenv(HOSTNAME_ENV, "w1@h")
        get_settings.cache_clear()
        monkeypatch.setattr(w, "enqueue_job", lambda job_id, queue=None: None)
        fillers: list[Path] = []
        if previous:  # the disk fills up right after the first checkpoint (step 4)
            on_checkpoint = reporter.DBReporter._on_checkpoint

            def fill_after(self: reporter.DBReporter, ev: Any) -> Any:
                if not fillers:
                    fillers.append(fill(jobs_dir))
                return on_checkpoint(self, ev)

            monkeypatch.setattr(reporter.DBReporter, "_on_checkpoint", fill_after)
        else:
            fillers.append(fill(jobs_dir))
        data = sums_file(tmp_path / "d.jsonl", n=40)  # 10 steps of 4, a checkpoint every 4
        job_id = make_job(url, data, hyperparameters={"checkpoint_every": 4}, queue=unique_queue)

        def claim_and_run() -> int:
            claimed = w.claim_next_job(job_id, "w1@h", settings, queue=unique_queue)
            assert (claimed.outcome.value, claimed.job_id) == ("claimed", job_id)
            return run_job_process(job_id)

        def settle(rc: int, n: int) -> str:
            """The worker's policy after the exit: queued at once, the run ended before the wait."""
            assert rc == EXIT_DISK_FULL
            assert w.finish_after_exit(job_id, rc, "w1@h", settings) == "requeued"
            settled = utcnow()
            job = get_job(url, job_id)
            assert (job.status, job.attempts, job.worker_hostname) == ("queued", 0, None)
            run = _runs(url, job_id)[-1]
            ended, not_before = as_utc(run.ended_at), as_utc(job.not_before)
            assert ended is not None and not_before is not None and ended <= settled
            assert not_before - ended >= timedelta(seconds=BACKOFF * 2 ** (n - 1))  # the wait: after the run
            assert run.gpu_seconds == pytest.approx((ended - as_utc(run.started_at)).total_seconds())  # type: ignore[operator]
            assert _event_data(url, job_id, "disk_full_requeues")["disk_full_requeues"] == n
            return job_id

        def wait_out() -> None:
            """Until the job's wait is over (bounded by the wait itself), then the reaper's dispatch."""
            not_before = as_utc(get_job(url, job_id).not_before)
            assert not_before is not None
            time.sleep(max(0.0, (not_before - utcnow()).total_seconds()) + 0.05)
            later = utcnow() + timedelta(seconds=settings.dispatch_grace_seconds + 1)
            assert job_id in dispatch_undispatched_jobs(
                settings=settings, now=later, enqueue=lambda j, q: None
            )

        settle(claim_and_run(), 1)
        msgs = messages(url, job_id)
        kept = list_checkpoints(jobs_dir / job_id)
        if previous:
            assert [c.step for c in kept] == [4]
            before = digest(kept[0].path)
            assert msgs[-3] == "no space left while writing checkpoint 8"
            assert msgs[-2].startswith(
                "No space left while writing checkpoint 8; the previous checkpoint checkpoint-000004 "
                "(step 4) is kept. The job waits 1 s off the GPU before it runs again (disk-full "
                "re-queue 1/2"
            )
            assert msgs[-1].endswith("; re-queued to resume from step 4")

            # claimed again while the disk is still full: it stops before it loads anything
            wait_out()
            count = len(messages(url, job_id))
            settle(claim_and_run(), 2)
            msgs = messages(url, job_id)
            assert msgs[count].startswith("Attempt 1/3 started on w1@h, resuming from step 4"), msgs[count:]
            assert msgs[count + 1].startswith("no space left for another checkpoint: ")
            assert "checkpoint-000004 (step 4) takes" in msgs[count + 1]
            assert not [m for m in msgs[count:] if m.startswith(("Training", "Step "))], msgs[count:]
            assert "the previous checkpoint checkpoint-000004 (step 4) is kept" in msgs[-2]
            assert "(disk-full re-queue 2/2" in msgs[-2] and msgs[-1].endswith("to resume from step 4")
            assert digest(kept[0].path) == before
        else:
            assert kept == []
            assert msgs[-3] == "no space left while writing checkpoint 4"
            assert msgs[-2].startswith(
                "No space left while writing checkpoint 4; no checkpoint exists yet; the job will restart "
                "from step 0. The job waits 1 s off the GPU"
            )
            assert msgs[-1].endswith("; re-queued to restart from step 0 (no checkpoint yet)")
            assert not [m for m in msgs if "previous checkpoint" in m or "resum" in m], msgs

        # space back: the next run resumes from the checkpoint kept (or starts over) and succeeds
        fillers[0].unlink()
        wait_out()
        count = len(messages(url, job_id))
        assert claim_and_run() == 0
        msgs = messages(url, job_id)[count:]
        job = get_job(url, job_id)
        assert job.status == "succeeded" and job.attempts == 1 and job.error is None, msgs
        if previous:
            assert msgs[0] == "Attempt 1/3 started on w1@h, resuming from step 4"
            assert any(m.startswith("Training resumed at step 4: 10 steps") for m in msgs), msgs
        else:
            assert msgs[0] == "Attempt 1/3 started on w1@h, restarting from step 0 (no checkpoint yet)"
            assert any(m.startswith("Training started: 10 steps") for m in msgs), msgs
        runs = _runs(url, job_id)
        assert all(r.ended_at is not None for r in runs) and len(runs) == (3 if previous else 2)
        for a, b in itertools.pairwise(runs):  # between the runs, the waits: no run at all
            assert as_utc(b.started_at) >= as_utc(a.ended_at) + timedelta(seconds=BACKOFF)  # type: ignore[operator]

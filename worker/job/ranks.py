"""The ranks of a job on N > 1 GPUs beside rank 0's runner (:mod:`worker.job.runner`): rank 0 hands
its JobSpec and resolution to the others (:class:`Announce`), which train it without touching the database
(:func:`run_peer_rank`); :func:`peer_lost` tells a rank's own failure from its collective breaking
because another rank died.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Any

from worker.job.exits import EXIT_DISK_FULL, EXIT_DONE

log = logging.getLogger("zenflow.job_runner")


class Announce:
    """Rank 0 tells the other ranks, once, whether the job runs: its (JobSpec, Resolution), or None (not
    ours, refused, invalid, failed to start); a no-op without a group."""

    def __init__(self, dist: Any) -> None:
        self.dist, self.done = dist, dist is None

    def __call__(self, job: Any) -> None:
        if self.done:
            return
        self.done = True
        from trainer.run.distributed import broadcast_object

        try:
            broadcast_object(self.dist, job)
        except Exception:  # the peers are gone: the supervisor settles the group
            log.exception("could not hand the job to the other ranks")


_PEER_LOST_SIGNS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "nccl error",
    "nccl communicator",
    "gloo",
)


def peer_lost(e: BaseException) -> bool:
    """Whether a rank's training error is its collective breaking (a peer rank died), not its own
    failure: torch.distributed's errors, and gloo's and NCCL's plain RuntimeErrors about the link."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        dist_error = getattr(sys.modules.get("torch.distributed"), "DistError", None)
        if dist_error is not None and isinstance(cur, dist_error):
            return True
        if isinstance(cur, RuntimeError) and any(s in str(cur).lower() for s in _PEER_LOST_SIGNS):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def run_peer_rank(job_id: str, dist: Any) -> int:
    """Rank > 0 of a job's group: train the JobSpec rank 0 hands over, with its resolution (none: exit at
    once) and its own worker's Python grader limits (worker.grading), and report
    only this rank's step metrics, to Prometheus. Exit 0 when the run ends (done, cancelled, or an
    input error rank 0 reports), 74 on a full disk, 1 on any other failure (logged here)."""
    from store.serving_endpoint import get_serving_endpoint
    from store.settings import get_settings
    from trainer.data.dataset import DatasetValidationError
    from trainer.model.catalog import UnknownModelError
    from trainer.model.folder_check import ModelFolderError
    from trainer.run.checkpoint import DiskFullError, is_out_of_space
    from trainer.run.distributed import broadcast_object
    from trainer.run.loop import run_training
    from worker.grading import job_grading
    from worker.metrics.telemetry import track_job

    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())  # preempted: stop with the others
    try:
        job = broadcast_object(dist, None)
        if job is None:
            return EXIT_DONE
        spec, resolution = job
        mode = resolution.job.engine.mode if resolution is not None else "unknown"
        with (
            job_grading(get_settings(), get_serving_endpoint(), spec.method) as grading,  # its own worker's
            track_job(job_id, base_model=spec.model, mode=mode, count=False) as tj,
        ):
            run_training(
                spec,
                on_event=tj.wrap(),
                should_cancel=stop.is_set,
                dist=dist,
                resolution=resolution,
                grading=grading,
            )
    except (DatasetValidationError, UnknownModelError, ModelFolderError) as e:
        log.info("job %s rank %d: %s (rank 0 reports it)", job_id, dist.rank, e)
    except Exception as e:
        if isinstance(e, DiskFullError) or is_out_of_space(e):
            log.error("job %s rank %d: %s", job_id, dist.rank, e)
            return EXIT_DISK_FULL
        log.exception("job %s rank %d failed", job_id, dist.rank)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    return EXIT_DONE

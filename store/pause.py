"""A user's pause and resume of a job (``POST /v1/fine_tuning/jobs/{id}/pause`` and ``/resume``).

A paused job (``JobStatus.paused``, not terminal) is off the queue and off the GPUs: no worker claims it
(:func:`store.jobs.claim`), the dispatcher and the reaper leave it alone (they look at queued and running
jobs), fair share does not rank it and the quotas count it neither as running nor as waiting. It keeps
everything it needs to go on: its row (request, resolutions, ``created_at``, attempts), its output
directory with its checkpoints, its files (not deletable while it is paused, as for a waiting job).

- :func:`request_pause`: a waiting job is paused at once (:func:`store.jobs.pause`); a running one gets
  ``pause_requested`` and an event, and its runner, which polls the flag (worker.job.monitor), stops at
  its next step as a cancel does (checkpointing there: the loop's ``should_cancel``) and writes
  ``paused`` ("Job paused at step N"), its run ended in the ledger. A run that ends otherwise while the
  pause is pending (its process killed, its worker lost) is paused rather than re-queued.
- :func:`resume`: a paused job is ``queued`` again as the same job, admitted by its team's quotas first
  as a create is (the caller: ``store.quotas.admit_job`` under the team's row lock) and sent to its
  queue after the commit (``worker.broker.enqueue_job``, then ``mark_dispatched``; the reaper's
  dispatcher sends it when that fails). It keeps its ``created_at``, by which fair share orders a team's
  waiting jobs (store.fairshare), so it ranks where a job created then ranks, not behind the team's newer
  jobs; its next run resumes from the checkpoint it paused at, with its current resolution while the
  worker's machine is the one it was resolved for (worker.job.runner).
- A cancel of a paused job cancels it at once (:func:`store.jobs.request_cancel`).
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from store.jobs import PENDING, add_event, pause, resume_words, set_status
from store.orm import FineTuningJob, JobStatus

#: The statuses a pause applies to (the others: 409 ``job_not_pausable``, or a no-op for ``paused``).
PAUSABLE = (*PENDING, JobStatus.running.value)


def request_pause(session: Session, job: FineTuningJob) -> None:
    """A user's pause of ``job`` (row locked by the caller): a waiting job is paused at once (its message,
    when a worker takes it, claims another job or none), a running one is flagged and stops at its next
    step; a paused job or a pending pause is left as it is. The caller refuses the other statuses (not
    :data:`PAUSABLE`) and a pending cancel first."""
    if job.status == JobStatus.paused.value or job.pause_requested:
        return
    if job.status in PENDING:
        pause(session, job, "Job paused while waiting in its queue")
        return
    job.pause_requested = True
    add_event(
        session,
        job.id,
        "Pause requested; the job stops after the current step, checkpointing there",
        data={"status": job.status, "pause_requested": True},
    )


def resume(session: Session, job: FineTuningJob) -> str:
    """Put a paused job (row locked by the caller) back in its queue; the queue to send it to."""
    if job.status != JobStatus.paused.value:
        raise ValueError(f"job {job.id} is {job.status}, not paused")
    set_status(session, job, JobStatus.queued, message=f"Job resumed: queued {resume_words(session, job)}")
    return job.queue

"""Fair share between teams: the order in which a queue's waiting jobs run, as one SQL statement.

The policy (written here only; the worker's claim and the API's ``queue_position`` both use
:func:`fair_order`) is round-robin between teams, counting the jobs a team already runs:

1. a team's waiting jobs are taken oldest first; its k-th waiting job (k = 1, 2, ...) belongs to
   round ``running + k``, where ``running`` is how many of the team's jobs of this queue run now.
   A team with jobs running waits behind teams with fewer; a team that submits many jobs at once
   gets one per round, so another team's single job is never stuck behind all of them;
2. within a round, a team that entered it with more running jobs goes first (its earlier rounds
   were already served, so its place in the rotation was taken before the others');
3. then the team served least recently (the last start of any of its runs on this queue; never
   served first), so teams take turns in the order they last ran;
4. then the team whose oldest waiting job is oldest, then the job's creation time and id.

With one worker and teams A (four jobs) and B (two, submitted after A's) the run order is
A, B, A, B, A, A; ``queue_position`` shows that order before any of them starts. The order looks
only at job rows and the run ledger (``fine_tuning_job_runs``): a team held back by its
``max_running_jobs`` quota keeps its place here and is skipped by the claim
(:func:`store.jobs.claim_next`) until one of its jobs ends, and one at its ``gpu_hours`` quota until
enough of its use has left the rolling window (store.quotas).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Subquery, and_, case, func, select
from sqlalchemy.orm import aliased

from store.orm import FineTuningJob, JobRun, JobStatus

#: Jobs waiting for a worker (they have a queue position).
WAITING = (JobStatus.validating_files.value, JobStatus.queued.value)


def fair_order(queue: ColumnElement[Any] | str | None = None, *, name: str = "fair_share") -> Subquery:
    """The waiting jobs of ``queue`` (every queue when None) with ``pos``, 1 = the job the queue's
    next claim takes, ranked per queue by the policy of this module; columns job_id, team_id, queue, pos.

    ``queue`` may be a SQL expression (the API ranks one job's queue by a subquery on its id).
    """
    w = aliased(FineTuningJob, name=f"{name}_w")
    cond: list[ColumnElement[bool]] = [w.status.in_(WAITING)]
    if queue is not None:
        cond.append(w.queue == queue)
    waiting = (
        select(
            w.id.label("job_id"),
            w.team_id,
            w.queue,
            w.created_at,
            func.row_number()
            .over(partition_by=(w.queue, w.team_id), order_by=(w.created_at, w.id))
            .label("k"),
            func.min(w.created_at).over(partition_by=(w.queue, w.team_id)).label("team_first"),
        )
        .where(*cond)
        .cte(f"{name}_waiting")
    )
    teams = select(waiting.c.team_id, waiting.c.queue).distinct().subquery(f"{name}_teams")
    r = aliased(FineTuningJob, name=f"{name}_r")
    running = (
        select(func.count())
        .select_from(r)
        .where(r.team_id == teams.c.team_id, r.queue == teams.c.queue, r.status == JobStatus.running.value)
        .scalar_subquery()
    )
    last_start = (
        select(func.max(JobRun.started_at))
        .where(JobRun.team_id == teams.c.team_id, JobRun.queue == teams.c.queue)
        .scalar_subquery()
    )
    stats = select(
        teams.c.team_id, teams.c.queue, running.label("running"), last_start.label("last_start")
    ).subquery(f"{name}_stats")
    key = (
        stats.c.running + waiting.c.k,  # 1. the round
        -stats.c.running,  # 2. more running jobs first within a round
        case((stats.c.last_start.is_(None), 0), else_=1),  # 3. never served first,
        stats.c.last_start,  # then least recently served
        waiting.c.team_first,  # 4. the team's oldest waiting job, then the job itself
        waiting.c.created_at,
        waiting.c.job_id,
    )
    return (
        select(
            waiting.c.job_id,
            waiting.c.team_id,
            waiting.c.queue,
            func.row_number().over(partition_by=waiting.c.queue, order_by=key).label("pos"),
        )
        .join(stats, and_(stats.c.team_id == waiting.c.team_id, stats.c.queue == waiting.c.queue))
        .subquery(name)
    )

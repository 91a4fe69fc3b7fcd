"""Redis without persistence (no AOF, no snapshots: our CI's Redis) restarted while a job waits in it:
the message is gone, yet the job runs, once.

The API commits the job, enqueues it and records ``dispatched_at``; Redis restarts empty before any
worker took the message. The first worker to start runs the dispatch reconciler in its reaper thread
(worker.dispatch): the queue holds no message for a job dispatched longer than the grace ago, so the
job is dispatched again, with a "Broker message lost" event, and runs.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.faults.harness import Client, RedisServer, job_params, stack
from tests.support import startup_seconds
from worker.dispatch import LOST_EVENT

pytestmark = [pytest.mark.services, pytest.mark.slow, pytest.mark.timeout(300)]


def test_queued_job_survives_a_redis_restart_without_persistence(tmp_path: Path) -> None:
    import redis as r

    # The grace covers a worker holding the re-sent message before its claim: a reaper round inside
    # that moment would re-send it once more (a second LOST_EVENT). On a quiet machine 1 s; on a
    # loaded one, as long as a process start-up takes there (tests.support.startup_seconds).
    grace = max(1.0, 2 * startup_seconds())
    redis = RedisServer(tmp_path / "redis", persistent=False).start()
    try:
        with stack(
            tmp_path, prefix="zf_nopersist", redis=redis, ZENFLOW_DISPATCH_GRACE_SECONDS=f"{grace:.1f}"
        ) as st:
            c = Client(st.start_api(), st.create_team_key()[1])
            job_id = c.create_job(c.upload(), **job_params(4, checkpoint_every=4))
            assert st.job(job_id).status == "queued" and st.job(job_id).dispatched_at is not None
            assert r.Redis(port=redis.port).llen(st.queue) == 1, "the job's message waits in the broker"

            redis.restart()
            assert r.Redis(port=redis.port).llen(st.queue) == 0, "a restart without persistence loses it"
            time.sleep(grace)

            st.start_worker("np")
            done = st.wait_status(job_id, {"succeeded", "failed", "cancelled"}, 240)
            assert done.status == "succeeded" and done.attempts == 1, (done.status, done.error)
            msgs = [e.message for e in st.events(job_id)]
            assert msgs.count(LOST_EVENT) == 1, msgs
            assert sum(m.startswith("Attempt ") for m in msgs) == 1, msgs
    finally:
        redis.stop()

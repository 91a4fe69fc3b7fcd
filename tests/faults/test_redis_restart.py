"""Redis (the broker) restarted mid-job: nothing is lost.

Redis runs as in docker-compose.yml (AOF on, noeviction), here a private redis-server on a free port.
While a job trains, a second job waits in the broker's queue; Redis is shut down and started again.
The running job goes on (the runner talks only to the database) and succeeds once; the queued job's
message survives the restart and it runs too; a job created while Redis is down is either refused
with 503 (and leaves no row behind) or, if accepted, runs. No job runs twice.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.harness import Client, RedisServer, job_params, stack, wait_until

pytestmark = [pytest.mark.services, pytest.mark.slow, pytest.mark.timeout(600)]


def test_redis_restart_mid_job_loses_nothing(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path / "redis").start()
    try:
        with stack(tmp_path, prefix="zf_redis", redis=redis) as st:
            api = st.start_api()
            st.start_worker("rr")
            _, key = st.create_team_key()
            c = Client(api, key)
            fid = c.upload()
            long_job = c.create_job(fid, **job_params(200, checkpoint_every=100))
            wait_until(
                lambda: st.job(long_job).status == "running" and st.job(long_job).global_step >= 5,
                240,
                "the first job to train",
                interval=0.1,
            )
            queued_job = c.create_job(fid, **job_params(10, checkpoint_every=10))
            assert st.job(queued_job).status == "queued"
            assert redis_len(redis, st.queue) == 1, "the second job waits in the broker"

            redis.stop()
            r = c.http.post(
                "/v1/fine_tuning/jobs",
                json={"model": "tiny-llama", "training_file": fid, **job_params(10, checkpoint_every=10)},
            )
            during = None
            if r.status_code == 200:
                during = r.json()["id"]
            else:
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "broker_unavailable"
            step_before = st.job(long_job).global_step
            redis.start()
            assert st.job(long_job).global_step >= step_before  # it trained on meanwhile

            jobs = [long_job, queued_job] + ([during] if during else [])
            for j in jobs:
                done = st.wait_status(j, {"succeeded", "failed", "cancelled"}, 300)
                assert done.status == "succeeded", (j, done.status, done.error)
                assert done.attempts == 1, (j, done.attempts)
            after = c.create_job(fid, **job_params(5, checkpoint_every=5))  # the broker works again
            assert st.wait_status(after, {"succeeded", "failed"}, 300).status == "succeeded"

            from sqlalchemy import func, select

            from store.orm import FineTuningJob

            with st.session() as s:
                n = s.scalar(select(func.count()).select_from(FineTuningJob))
            assert n == len(jobs) + 1, "a refused create leaves no job row"
            for j in jobs:
                msgs = [e.message for e in st.events(j)]
                assert sum(m.startswith("Attempt ") for m in msgs) == 1, msgs
    finally:
        redis.stop()


def redis_len(redis: RedisServer, queue: str) -> int:
    import redis as r

    return int(r.Redis(port=redis.port).llen(queue))

"""Issue 23 part 4: the job object says whether the run's weights were sharded. The reporter records the
run's resolved ``engine.shard_params`` (RunStarted.sharded) on the job row, and the API's job object shows
it as ``engine.shard_params`` (a bool replacing the request's ``auto``), not among the hyperparameters."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.jobs.views import job_dict
from tests.worker.test_job_db_outage import HOSTNAME, _running_job, db_url, events  # noqa: F401  (fixture)
from tests.worker.test_worker import get_job as job_row
from trainer.events import RUN_SHARDED, RunStarted
from worker.job.reporter import DBReporter
from worker.job.writer import ReportWriter

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]


def _started(sharded: bool, world: int) -> RunStarted:
    return RunStarted(
        total_steps=10,
        start_step=0,
        hyperparameters={"n_epochs": 1, "batch_size": 4},
        device="cpu",
        dtype="float32",
        mode="offload",
        num_parameters=100,
        trainable_parameters=100,
        num_examples=40,
        num_validation_examples=0,
        sharded=sharded,
        world_size=world,
    )


@pytest.mark.parametrize(("sharded", "world"), [(True, 2), (False, 1)])
def test_the_job_object_shows_whether_the_run_was_sharded(
    db_url: str,  # noqa: F811
    tmp_path: Path,
    sharded: bool,
    world: int,
) -> None:
    from sqlalchemy import update

    from store.db import session_scope
    from store.orm import FineTuningJob

    job_id = _running_job(db_url, tmp_path)
    with session_scope(db_url) as s:  # the request asked for auto
        s.execute(
            update(FineTuningJob).where(FineTuningJob.id == job_id).values(engine={"shard_params": "auto"})
        )
    before = job_dict(job_row(db_url, job_id), None)
    assert before["engine"] == {"shard_params": "auto"}  # not started: the request's value
    w = ReportWriter(db_url, job_id, HOSTNAME, outage_seconds=60, max_items=20, on_lost=lambda: None)
    w.start()
    try:
        DBReporter(w)(_started(sharded, world))
        assert w.flush(30)
    finally:
        w.close()
    row = job_row(db_url, job_id)
    assert row.resolved_hyperparameters[RUN_SHARDED] is sharded  # type: ignore[index]
    obj = job_dict(row, None)
    assert obj["engine"] == {"shard_params": sharded}
    assert RUN_SHARDED not in obj["hyperparameters"] and obj["hyperparameters"]["batch_size"] == 4
    (started,) = [e for e in events(db_url, job_id) if e.message.startswith("Training started")]
    assert started.data is not None
    assert (started.data["sharded"], started.data["world_size"]) == (sharded, world)

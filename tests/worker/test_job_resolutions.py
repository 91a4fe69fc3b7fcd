"""A resolution the run makes is recorded beside the job's first (the reporter appends the run's
``Resolved`` event to the row), and the job object shows the current one: every value concrete, each
with its source, and what each decision changed."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.jobs.views import job_dict
from tests.worker.test_job_db_outage import HOSTNAME, _running_job, db_url  # noqa: F401  (fixture)
from tests.worker.test_worker import get_job as job_row
from trainer.events import Resolved
from trainer.plan.gpus import GiB, Machine
from trainer.resolve import Counts, Pins, for_run, resolve
from trainer.spec import JobSpec
from worker.job.reporter import DBReporter
from worker.job.writer import ReportWriter

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]


def test_a_runs_resolution_is_recorded_beside_the_first(db_url: str, tmp_path: Path) -> None:  # noqa: F811
    from sqlalchemy import update

    from store.db import session_scope
    from store.orm import FineTuningJob

    job_id = _running_job(db_url, tmp_path)
    spec = JobSpec(model="tiny-llama", training_file="t.jsonl", engine={"mode": "auto"})
    machine = Machine.for_cpu(host_memory_bytes=16 * GiB, cores=2)
    first, _ = resolve(spec, machine, Counts(40), at="create", reason="the job was created")
    with session_scope(db_url) as s:
        s.execute(update(FineTuningJob).where(FineTuningJob.id == job_id).values(resolutions=[first]))
    before = job_dict(job_row(db_url, job_id), None)
    assert before["engine"]["mode"] == first.job.engine.mode != "auto"
    assert before["sources"]["engine.mode"] == "plan" and before["sources"]["engine.topk_ratio"] == "model"
    assert [r["at"] for r in before["resolutions"]] == ["create"]

    other = "offload" if first.job.engine.mode != "offload" else "zenflow"
    again, _, new = for_run(spec, first, machine, Counts(40), Pins(other))  # type: ignore[arg-type]
    assert new
    w = ReportWriter(db_url, job_id, HOSTNAME, outage_seconds=60, max_items=20, on_lost=lambda: None)
    w.start()
    try:
        reporter = DBReporter(w)
        event = Resolved(again.model_dump(mode="json"), again.job.changes(first.job))
        reporter(event)
        reporter(event)  # written twice (a replayed spool): recorded once
        assert w.flush(30)
    finally:
        w.close()
    row = job_row(db_url, job_id)
    assert [r.at for r in row.resolutions] == ["create", "run"] and row.resolution == again
    obj = job_dict(row, None)
    assert obj["engine"]["mode"] == other and obj["sources"]["engine.mode"] == "resume"
    assert obj["resolutions"][1]["changes"]["engine.mode"] == {"from": first.job.engine.mode, "to": other}
    assert obj["resolutions"][1]["reason"].startswith("the checkpoint to resume ran in")

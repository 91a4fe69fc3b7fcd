"""A failed job has one error event: the failed end state's, carrying the error's type and a data
file's line errors (the run's ErrorEvent makes no second row). Runs the job runner in-process against
the real PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from store.db import session_scope
from store.orm import FineTuningJob, JobEvent
from store.settings import Settings
from tests.worker.test_worker import get_job, make_job

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture
def settings(service_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    from store.settings import get_settings

    monkeypatch.setenv("ZENFLOW_MODEL_ROOTS", str(tmp_path / "models"))
    get_settings.cache_clear()
    return get_settings()


def _error_events(url: str, job_id: str) -> list[tuple[str, dict[str, Any]]]:
    with session_scope(url) as s:
        rows = s.execute(
            select(JobEvent.message, JobEvent.data)
            .where(JobEvent.job_id == job_id, JobEvent.level == "error")
            .order_by(JobEvent.seq)
        ).all()
        return [(m, dict(d or {})) for m, d in rows]


def test_a_failed_job_has_one_error_event(settings: Settings, tmp_path: Path) -> None:
    from tests.model_folders import write_model_folder
    from worker.job.runner import run_job_process

    url = settings.resolved_database_url
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "bot", "content": "hi"}]}\n')
    job_id = make_job(url, bad)
    assert run_job_process(job_id) == 0
    assert get_job(url, job_id).status == "failed"
    [(message, data)] = _error_events(url, job_id)
    assert message.startswith("Invalid training_file: ") and data["status"] == "failed"
    assert data["error_type"] == "DatasetValidationError" and data["errors"][0]["line"] == 1

    # A training error: weights that pass the header check at create but do not load.
    folder = write_model_folder(tmp_path / "models" / "garbage", "llama", weights=False)
    (folder / "pytorch_model.bin").write_bytes(b"not a torch checkpoint")
    data_file = tmp_path / "ok.jsonl"
    data_file.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}\n'
    )
    job_id = make_job(url, data_file)
    with session_scope(url) as s:
        s.get(FineTuningJob, job_id).model = "garbage"  # type: ignore[union-attr]
    assert run_job_process(job_id) == 0
    job = get_job(url, job_id)
    assert job.status == "failed" and job.error["code"] == "training_error"  # type: ignore[index]
    [(message, data)] = _error_events(url, job_id)
    assert message.startswith("Training failed: ") and data["error_type"] == "UnpicklingError"

"""The engine's tuning is each worker's (``ZENFLOW_ENGINE_TUNING``), never a job's: a worker whose tuning
the engine refuses does not start (the field named), and a valid one reaches every job it runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _import_hooks(tuning: dict[str, object]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ZENFLOW_ENGINE_TUNING": json.dumps(tuning)}
    return subprocess.run(
        [sys.executable, "-c", "import worker.hooks"], cwd=ROOT, env=env, capture_output=True, text=True
    )


@pytest.mark.services
def test_a_worker_with_a_bad_tuning_does_not_start() -> None:
    bad = _import_hooks({"cpu_threads": 0})
    assert bad.returncode != 0 and "cpu_threads" in bad.stderr
    job_setting = _import_hooks({"topk_ratio": 0.2})  # a job's setting is no worker's tuning
    assert job_setting.returncode != 0 and "not engine tuning fields: topk_ratio" in job_setting.stderr
    assert _import_hooks({"cpu_chunk_elements": 1 << 20, "bind_worker_cores": False}).returncode == 0


def test_the_workers_tuning_reaches_the_jobs_engine(tmp_path: Path) -> None:
    from contract.job import JobRequest
    from trainer.resolve import Counts, resolve
    from trainer.run.setup import engine_config
    from trainer.spec import spec_of_request

    request = JobRequest(model="tiny-llama", training_file="file-1")
    tuning = {"cpu_chunk_elements": 1 << 20, "bind_worker_cores": False}
    spec = spec_of_request(
        request, model="tiny-llama", training_file=tmp_path / "t.jsonl", validation_file=None,
        output_dir=tmp_path, engine_tuning=tuning,
    )  # fmt: skip
    job = resolve(spec, None, Counts(40), at="run", reason="t")[0].job
    config = engine_config(job, 1e-3, spec.engine_tuning)
    assert (config.cpu_chunk_elements, config.bind_worker_cores) == (1 << 20, False)
    assert config.topk_ratio == job.engine.topk_ratio == 0.25  # the job's own knobs, from its resolution

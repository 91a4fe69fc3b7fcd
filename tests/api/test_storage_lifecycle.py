"""Storage that is cleaned up: the trainer's checkpoint pruning across a resume, the retention policy on
finished jobs (api.retention), the purge of a job's outputs (``zenflow jobs purge``), per-team storage
accounting (store.usage), and file deletion (result files leave ``result_files``; a training file is
refused while a queued or running job uses it, and deletable once the jobs using it are finished)."""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select

from api.core.config import ApiSettings
from api.retention import ForeignPathError, JobNotFinishedError, apply_retention, purge_job_outputs
from store.ids import new_id
from store.orm import File, FineTuningJob, JobCheckpoint, JobEvent, JobStatus
from store.settings import Settings
from store.usage import DirectorySizeCache, directory_bytes, team_storage_bytes, team_storage_usage
from tests.api.conftest import TEST_API_SETTINGS, Enqueued, TeamKey, error_of, make_team, uploaded_id
from trainer.run.checkpoint import FINAL_DIR, list_checkpoints

# --- a real finished run, shared ------------------------------------------------------------------


def _sums(path: Path, n: int = 24) -> Path:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b)}) + "\n")
    return path


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, torch_single_thread: None) -> Path:
    """tiny-llama on the CPU, checkpoints every 2 steps, keep_checkpoints=2, cancelled after step 3 and
    resumed to its end (step 6): the trainer's pruning holds across the resume and at the end."""
    from trainer.events import Event
    from trainer.run.loop import run_training
    from trainer.spec import JobSpec

    root = tmp_path_factory.mktemp("run")
    data = _sums(root / "sums.jsonl")
    out = root / "out"
    spec = JobSpec.model_validate(
        {
            "model": "tiny-llama",
            "training_file": str(data),
            "output_dir": str(out),
            "device": "cpu",
            "keep_checkpoints": 2,
            "hyperparameters": {
                "n_epochs": 1,
                "batch_size": 4,
                "max_seq_length": 32,
                "checkpoint_every": 2,
                "seed": 1,
            },
        }
    )
    steps: list[int] = []

    def on_event(ev: Event) -> None:
        if ev.type == "step":
            steps.append(ev.step)  # type: ignore[attr-defined]

    cut = run_training(spec, on_event=on_event, should_cancel=lambda: len(steps) >= 3)
    assert cut.cancelled and [c.step for c in list_checkpoints(out)] == [2, 3]
    done = run_training(spec, on_event=on_event)
    assert not done.cancelled and done.steps == 6
    assert [c.step for c in list_checkpoints(out)] == [4, 6], (
        "keep_checkpoints held after the resume and the end"
    )
    assert (out / FINAL_DIR).is_dir()
    return out


def _job_with_outputs(
    app: FastAPI,
    settings: Settings,
    team: TeamKey,
    file_id: str,
    run: Path,
    status: JobStatus = JobStatus.succeeded,
) -> tuple[str, Path]:
    """A job row of ``team`` whose output directory (under jobs_dir) is a copy of ``run``, with the
    checkpoint rows the reporter would have written, plus a stale one for a step long gone."""
    job = FineTuningJob(
        id=new_id("ftjob"),
        team_id=team.id,
        model="tiny-llama",
        training_file_id=file_id,
        status=status.value,
        queue="q",
    )
    out = settings.resolved_jobs_dir / job.id
    shutil.copytree(run, out)
    # keep final/'s weights hard-linked to the last checkpoint's, as the trainer leaves them
    for p in (out / FINAL_DIR).rglob("*"):
        twin = out / "checkpoint-000006" / p.relative_to(out / FINAL_DIR)
        if p.is_file() and twin.is_file():
            p.unlink()
            os.link(twin, p)
    job.output_dir = str(out)
    job.fine_tuned_model = str(out / FINAL_DIR)
    with app.state.sessionmaker() as s:
        s.add(job)
        s.flush()
        for step in (2, 4):  # 2: pruned by the trainer, its row delete lost; 6: its row never written
            s.add(
                JobCheckpoint(
                    job_id=job.id,
                    step_number=step,
                    path=str(out / f"checkpoint-{step:06d}"),
                    fine_tuned_model_checkpoint=str(out / f"checkpoint-{step:06d}"),
                )
            )
        s.commit()
    return job.id, out


def _checkpoint_steps(app: FastAPI, job_id: str) -> list[int]:
    with app.state.sessionmaker() as s:
        return sorted(s.scalars(select(JobCheckpoint.step_number).where(JobCheckpoint.job_id == job_id)))


def _events(app: FastAPI, job_id: str) -> list[str]:
    with app.state.sessionmaker() as s:
        return list(
            s.scalars(select(JobEvent.message).where(JobEvent.job_id == job_id).order_by(JobEvent.seq))
        )


# --- retention and purge ------------------------------------------------------------------------


def test_retention_keeps_newest_checkpoints_and_final_model(
    app: FastAPI, client: TestClient, settings: Settings, team: TeamKey, trained_run: Path
) -> None:
    from transformers import AutoModelForCausalLM

    job_id, out = _job_with_outputs(app, settings, team, uploaded_id(client, team), trained_run)
    (out / "checkpoint-000008.tmp-dead").mkdir()  # an interrupted write's leftover
    before = directory_bytes(out)
    with app.state.sessionmaker() as s:
        job = s.get(FineTuningJob, job_id)
        assert job is not None
        pruned = apply_retention(s, job, keep=1, jobs_dir=settings.resolved_jobs_dir)
        s.commit()
    assert [c.step for c in list_checkpoints(out)] == [6]
    assert not (out / "checkpoint-000004").exists() and not (out / "checkpoint-000008.tmp-dead").exists()
    assert pruned.freed_bytes == before - directory_bytes(out) > 0
    assert _checkpoint_steps(app, job_id) == [6], "rows match the directories: stale deleted, missing added"
    assert any(m.startswith("Retention: removed") for m in _events(app, job_id))
    AutoModelForCausalLM.from_pretrained(out / FINAL_DIR)  # the final model is whole

    # keep=0: the final model alone, still loadable (its weights were hard links of the last checkpoint's)
    with app.state.sessionmaker() as s:
        job = s.get(FineTuningJob, job_id)
        assert job is not None
        apply_retention(s, job, keep=0, jobs_dir=settings.resolved_jobs_dir)
        s.commit()
    assert list_checkpoints(out) == [] and _checkpoint_steps(app, job_id) == []
    AutoModelForCausalLM.from_pretrained(out / FINAL_DIR)


def test_retention_refuses_unfinished_jobs_and_leaves_foreign_paths(
    app: FastAPI, client: TestClient, settings: Settings, team: TeamKey, trained_run: Path, tmp_path: Path
) -> None:
    job_id, out = _job_with_outputs(
        app, settings, team, uploaded_id(client, team), trained_run, status=JobStatus.running
    )
    with app.state.sessionmaker() as s:
        job = s.get(FineTuningJob, job_id)
        assert job is not None
        with pytest.raises(JobNotFinishedError):
            apply_retention(s, job, keep=0, jobs_dir=settings.resolved_jobs_dir)
        with pytest.raises(JobNotFinishedError):
            purge_job_outputs(s, job_id, jobs_dir=settings.resolved_jobs_dir)
    assert len(list_checkpoints(out)) == 2
    # A finished job whose output_dir is outside jobs_dir (a row that says "/" or another mount) is left alone.
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(trained_run, elsewhere)
    with app.state.sessionmaker() as s:
        job = s.get(FineTuningJob, job_id)
        assert job is not None
        job.status, job.output_dir = JobStatus.failed.value, str(elsewhere)
        s.commit()
        with pytest.raises(ForeignPathError):
            purge_job_outputs(s, job_id, jobs_dir=settings.resolved_jobs_dir)
        s.rollback()
        job = s.get(FineTuningJob, job_id)
        assert job is not None
        assert apply_retention(s, job, keep=0, jobs_dir=settings.resolved_jobs_dir).removed == []
        s.commit()
    assert len(list_checkpoints(elsewhere)) == 2 and _checkpoint_steps(app, job_id) == [2, 4]


def test_sweep_runs_in_the_api_and_purge_from_the_cli(
    settings: Settings,
    client: TestClient,
    app: FastAPI,
    trained_run: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    from api.app import create_app
    from api.cli.main import main
    from store.settings import get_settings

    # A jobs_dir of its own: the sweeps here touch only jobs under it, not other tests' jobs.
    settings = settings.model_copy(update={"jobs_dir": tmp_path / "jobs"})
    team = make_team(app)
    job_id, out = _job_with_outputs(app, settings, team, uploaded_id(client, team), trained_run)
    api_settings = TEST_API_SETTINGS.model_copy(
        update={"retention_interval_seconds": 0.2, "retain_checkpoints": 1}
    )
    with TestClient(create_app(settings, api_settings, enqueue=Enqueued())):
        deadline = time.monotonic() + 30
        while len(list_checkpoints(out)) != 1:
            assert time.monotonic() < deadline, "the API's retention sweep did not run"
            time.sleep(0.1)
    assert [c.step for c in list_checkpoints(out)] == [6]

    monkeypatch.setenv("ZENFLOW_DATABASE_URL", settings.resolved_database_url)
    monkeypatch.setenv("ZENFLOW_DATA_DIR", str(settings.data_dir))
    monkeypatch.setenv("ZENFLOW_JOBS_DIR", str(settings.jobs_dir))
    get_settings.cache_clear()
    try:
        with app.state.sessionmaker() as s:
            used = team_storage_usage(s, team.id).jobs_bytes
        assert used == directory_bytes(out) > 0
        assert main(["jobs", "purge", job_id]) == 0
        printed = capsys.readouterr().out
        assert f"job {job_id}: removed {out}" in printed and f"{used} bytes" in printed
        assert not out.exists() and _checkpoint_steps(app, job_id) == []
        assert any(m.startswith("Outputs removed") for m in _events(app, job_id))
        with app.state.sessionmaker() as s:
            assert team_storage_usage(s, team.id).jobs_bytes == 0
            assert s.get(FineTuningJob, job_id) is not None, "the job row stays"
        assert main(["jobs", "purge", "ftjob-nope"]) == 1
        assert "no such fine-tuning job" in capsys.readouterr().err
        assert main(["storage", "usage", "--team", team.name]) == 0
        assert "job outputs     0 bytes" in capsys.readouterr().out
        assert main(["storage", "sweep", "--keep", "2"]) == 0
        assert "retention (newest 2 checkpoint(s)" in capsys.readouterr().out
    finally:
        get_settings.cache_clear()


# --- accounting -----------------------------------------------------------------------------------


def test_team_storage_counts_files_results_and_outputs(
    app: FastAPI, client: TestClient, settings: Settings, trained_run: Path
) -> None:
    from store.results import add_results_file

    team, other = make_team(app), make_team(app)
    a, b = uploaded_id(client, team), uploaded_id(client, team)
    uploaded_id(client, other)
    job_id, out = _job_with_outputs(app, settings, team, a, trained_run)
    with app.state.sessionmaker() as s:
        job = s.get(FineTuningJob, job_id)
        assert job is not None
        results = add_results_file(s, job, settings.resolved_files_dir)
        s.commit()
        sizes = {f.id: f.bytes for f in s.scalars(select(File).where(File.team_id == team.id))}
    cache = DirectorySizeCache()
    with app.state.sessionmaker() as s:
        u = team_storage_usage(s, team.id, cache=cache)
        assert u.uploads_bytes == sizes[a] + sizes[b]
        assert u.results_bytes == sizes[results.id] == results.bytes
        hard_linked = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.stat().st_nlink == 1)
        assert u.jobs_bytes == directory_bytes(out) > hard_linked, "linked files are counted once"
        assert u.total_bytes == team_storage_bytes(s, team.id)
        assert team_storage_usage(s, other.id).jobs_bytes == 0, "a team counts only its own"

        # Cached: a write deep inside an output directory is seen once the directory itself changes
        # (checkpoints appear and go by rename directly under it).
        (out / "checkpoint-000006" / "extra.bin").write_bytes(b"x" * 1000)
        assert team_storage_usage(s, team.id, cache=cache).jobs_bytes == u.jobs_bytes
        (out / "checkpoint-000006").rename(out / "checkpoint-000007")
        assert team_storage_usage(s, team.id, cache=cache).jobs_bytes == u.jobs_bytes + 1000


# --- file deletion --------------------------------------------------------------------------------


def test_deleting_a_result_file_removes_it_from_result_files(
    app: FastAPI, client: TestClient, settings: Settings, team: TeamKey, other_team: TeamKey
) -> None:
    from store.results import add_results_file

    fid = uploaded_id(client, team)
    with app.state.sessionmaker() as s:
        job = FineTuningJob(
            team_id=team.id, model="tiny-llama", training_file_id=fid, status="succeeded", queue="q"
        )
        s.add(job)
        s.flush()
        first = add_results_file(s, job, settings.resolved_files_dir)
        second = add_results_file(s, job, settings.resolved_files_dir)
        s.commit()
        job_id, first_id, second_id, path = job.id, first.id, second.id, Path(first.storage_path)
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=team.headers).json()["result_files"] == [
        first_id,
        second_id,
    ]
    assert client.delete(f"/v1/files/{first_id}", headers=other_team.headers).status_code == 404
    r = client.delete(f"/v1/files/{first_id}", headers=team.headers)
    assert r.status_code == 200 and r.json() == {"id": first_id, "object": "file", "deleted": True}
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=team.headers).json()["result_files"] == [
        second_id
    ]
    assert not path.exists() and client.get(f"/v1/files/{first_id}", headers=team.headers).status_code == 404
    assert client.delete(f"/v1/files/{second_id}", headers=team.headers).status_code == 200
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=team.headers).json()["result_files"] == []


@pytest.fixture(params=["postgresql", "sqlite"])
def any_db(
    request: pytest.FixtureRequest, client: TestClient, app: FastAPI, tmp_path: Path, settings: Settings
) -> Iterator[tuple[TestClient, FastAPI, Settings]]:
    if request.param == "postgresql":
        yield client, app, settings
        return
    from api.app import create_app

    s = Settings(_env_file=None, data_dir=tmp_path / "var")  # type: ignore[call-arg]
    lite = create_app(s, ApiSettings(_env_file=None), enqueue=Enqueued())  # type: ignore[call-arg]
    with TestClient(lite) as c:
        yield c, lite, s


def test_training_file_deletable_only_once_its_jobs_are_finished(
    any_db: tuple[TestClient, FastAPI, Settings],
) -> None:
    client, app, settings = any_db
    team = make_team(app)
    fid = uploaded_id(client, team)
    path = settings.resolved_files_dir / team.id / f"{fid}.jsonl"
    assert path.is_file()
    job = client.post(
        "/v1/fine_tuning/jobs",
        headers=team.headers,
        json={"model": "tiny-llama", "training_file": fid, "validation_file": fid},
    ).json()
    for status in ("queued", "running"):
        with app.state.sessionmaker() as s:
            row = s.get(FineTuningJob, job["id"])
            assert row is not None
            row.status = status
            s.commit()
        r = client.delete(f"/v1/files/{fid}", headers=team.headers)
        assert r.status_code == 409, r.text
        err = error_of(r)
        assert (
            err["code"] == "file_in_use"
            and job["id"] in str(err["message"])
            and status in str(err["message"])
        )
        assert path.is_file()
    with app.state.sessionmaker() as s:
        row = s.get(FineTuningJob, job["id"])
        assert row is not None
        row.status = "succeeded"
        s.commit()
        used = team_storage_usage(s, team.id).uploads_bytes
    assert used > 0
    r = client.delete(f"/v1/files/{fid}", headers=team.headers)
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert not path.exists()
    assert client.get(f"/v1/files/{fid}", headers=team.headers).status_code == 404
    assert client.get(f"/v1/files/{fid}/content", headers=team.headers).status_code == 404
    assert fid not in [f["id"] for f in client.get("/v1/files", headers=team.headers).json()["data"]]
    assert client.delete(f"/v1/files/{fid}", headers=team.headers).status_code == 404
    got = client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=team.headers).json()
    assert got["training_file"] == fid, "the finished job still names its file"
    with app.state.sessionmaker() as s:
        assert team_storage_usage(s, team.id).uploads_bytes == 0
    r = client.post(
        "/v1/fine_tuning/jobs", headers=team.headers, json={"model": "tiny-llama", "training_file": fid}
    )
    assert r.status_code == 400 and error_of(r)["param"] == "training_file"
    # A file no job ever used goes entirely, row and bytes.
    unused = uploaded_id(client, team)
    assert client.delete(f"/v1/files/{unused}", headers=team.headers).status_code == 200
    with app.state.sessionmaker() as s:
        assert s.get(File, unused) is None

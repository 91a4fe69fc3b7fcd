"""Model ids, /v1/models and downloads: a tiny LoRA job run through the real job runner (in-process,
PostgreSQL) registers ``ft:`` ids for its result and checkpoints; the openai SDK lists and retrieves
them; a team never sees, downloads, deletes or trains on another team's model; a job's ``model`` is
never a server path; the downloaded tar loads with ``from_pretrained``; a job continues from an
``ft:`` checkpoint."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import shutil
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from store.orm import FineTuningJob, JobStatus, RegisteredModel
from store.settings import Settings
from tests.api.conftest import (
    TEST_API_SETTINGS,
    Enqueued,
    ServerThread,
    TeamKey,
    chat_jsonl,
    error_of,
    make_team,
    uploaded_id,
)

pytestmark = pytest.mark.usefixtures("torch_single_thread")

JOBS = "/v1/fine_tuning/jobs"
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
#: 16 examples (8 after the first job), batch 4: 4 steps, checkpoints at 2 and 4.
HYPER = {"n_epochs": 1, "batch_size": 4, "max_seq_length": 64, "checkpoint_every": 2}


@dataclass
class Trained:
    team: TeamKey
    other: TeamKey
    job_id: str
    model: str
    checkpoints: list[str]


@pytest.fixture(scope="module")
def msettings(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    root = tmp_path_factory.mktemp("zf-models")
    return settings.model_copy(update={"data_dir": root / "var", "model_roots": [root / "roots"]})


@pytest.fixture(scope="module")
def mapp(msettings: Settings) -> FastAPI:
    from api.app import create_app

    return create_app(msettings, TEST_API_SETTINGS, enqueue=Enqueued())


@pytest.fixture(scope="module")
def mclient(mapp: FastAPI) -> Iterator[TestClient]:
    with TestClient(mapp) as c:
        yield c


def _run(mclient: TestClient, msettings: Settings, team: TeamKey, body: dict[str, Any]) -> dict[str, Any]:
    """Create a job through the API and run it with the job runner, in this process."""
    from worker.job.runner import run_job_process

    r = mclient.post(JOBS, headers=team.headers, json=body)
    assert r.status_code == 200, r.text
    assert run_job_process(r.json()["id"], settings=msettings) == 0
    job: dict[str, Any] = mclient.get(f"{JOBS}/{r.json()['id']}", headers=team.headers).json()
    assert job["status"] == "succeeded", job
    return job


@pytest.fixture(scope="module")
def trained(mapp: FastAPI, mclient: TestClient, msettings: Settings) -> Trained:
    team, other = make_team(mapp, "Models Team"), make_team(mapp)
    fid = uploaded_id(mclient, team, chat_jsonl(16))
    hp = {**HYPER, "lora": LORA}
    job = _run(
        mclient,
        msettings,
        team,
        {"model": "tiny-llama", "training_file": fid, "suffix": "ids", "seed": 1, "hyperparameters": hp},
    )
    ckpts = mclient.get(f"{JOBS}/{job['id']}/checkpoints", headers=team.headers).json()["data"]
    # A folder under the model roots, named by its relative path: the job's own result as a "base model".
    with mapp.state.sessionmaker() as s:
        row = s.get(RegisteredModel, job["fine_tuned_model"])
        assert row is not None
        shutil.copytree(
            row.path,
            msettings.model_roots[0] / "org" / "base-model",
            ignore=shutil.ignore_patterns("adapter"),
        )
    checkpoints = [c["fine_tuned_model_checkpoint"] for c in ckpts]
    return Trained(team, other, job["id"], job["fine_tuned_model"], checkpoints)


def test_ids_have_openais_shape(trained: Trained, mclient: TestClient) -> None:
    assert trained.model == f"ft:tiny-llama:Models-Team:ids:{trained.job_id}"
    assert sorted(trained.checkpoints) == [f"{trained.model}:ckpt-step-2", f"{trained.model}:ckpt-step-4"]


def test_sdk_lists_and_retrieves_only_the_teams_models(trained: Trained, mapp: FastAPI) -> None:
    with ServerThread(mapp) as server:
        mine = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=trained.team.key, max_retries=0)
        theirs = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=trained.other.key, max_retries=0)
        listed = {m.id: m for m in mine.models.list()}
        assert {"tiny-llama", "small-llama", "org/base-model", trained.model, *trained.checkpoints} <= set(
            listed
        )
        assert listed[trained.model].owned_by == "Models Team" and listed[trained.model].object == "model"
        # what each is: a built-in's shape and random weights; a fine-tuned model's card
        assert "Random weights" in listed["tiny-llama"].description  # type: ignore[attr-defined]
        assert listed[trained.model].description  # type: ignore[attr-defined]
        assert listed["org/base-model"].owned_by == "system"
        got = mine.models.retrieve(trained.model)
        assert got.id == trained.model and got.created == listed[trained.model].created > 0
        assert mine.models.retrieve("org/base-model").id == "org/base-model"

        their_ids = {m.id for m in theirs.models.list()}
        assert {"tiny-llama", "org/base-model"} <= their_ids and not their_ids & {
            trained.model,
            *trained.checkpoints,
        }
        with pytest.raises(openai.NotFoundError) as foreign:
            theirs.models.retrieve(trained.model)
        with pytest.raises(openai.NotFoundError) as unknown:
            theirs.models.retrieve(trained.model + "0")
    assert foreign.value.code == unknown.value.code == "model_not_found"
    foreign_body, unknown_body = foreign.value.body, unknown.value.body
    assert isinstance(foreign_body, dict) and isinstance(unknown_body, dict)
    assert foreign_body["message"].replace(trained.model, "X") == unknown_body["message"].replace(
        trained.model + "0", "X"
    )


def _download(
    mclient: TestClient, team: TeamKey, model: str, headers: dict[str, str] | None = None, **params: str
) -> Any:
    return mclient.get(
        f"/v1/models/{model}/content", headers={**team.headers, **(headers or {})}, params=params
    )


def test_download_extracts_and_loads_with_from_pretrained(
    trained: Trained, mclient: TestClient, mapp: FastAPI, tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    r = _download(mclient, trained.team, trained.model)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
    assert int(r.headers["content-length"]) == len(r.content)
    assert r.headers["x-checksum-sha256"] == hashlib.sha256(r.content).hexdigest()
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "model", filter="data")
    assert "model.safetensors" in names and "config.json" in names
    assert not any(n.startswith("adapter") or n.endswith((".pt", "zenflow_checkpoint.json")) for n in names)
    again = _download(mclient, trained.team, trained.model)  # the cached checksum still holds: same bytes
    assert again.content == r.content and again.headers["x-checksum-sha256"] == r.headers["x-checksum-sha256"]

    with mapp.state.sessionmaker() as s:
        server_side = s.get(RegisteredModel, trained.model).path
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "model", local_files_only=True)(ids).logits
        want = AutoModelForCausalLM.from_pretrained(server_side, local_files_only=True)(ids).logits
    assert torch.equal(got, want)

    adapter = _download(mclient, trained.team, trained.checkpoints[0], format="adapter")
    assert adapter.status_code == 200, adapter.text
    assert adapter.headers["x-checksum-sha256"] == hashlib.sha256(adapter.content).hexdigest()
    with tarfile.open(fileobj=io.BytesIO(adapter.content)) as tar:
        tar.extractall(tmp_path / "adapter", filter="data")
    weights = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert weights and all("lora_" in k for k in weights)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


def test_download_errors(trained: Trained, mclient: TestClient) -> None:
    foreign = _download(mclient, trained.other, trained.model)
    unknown = _download(mclient, trained.other, "ft:nope")
    assert foreign.status_code == unknown.status_code == 404
    assert error_of(foreign)["code"] == error_of(unknown)["code"] == "model_not_found"
    assert _download(mclient, trained.other, trained.model, format="adapter").status_code == 404
    bad = _download(mclient, trained.team, trained.model, format="zip")
    assert bad.status_code == 400 and error_of(bad)["param"] == "format"
    base = _download(mclient, trained.team, "tiny-llama", format="adapter")  # a base has no adapter
    assert base.status_code == 400 and error_of(base)["code"] == "no_adapter", base.text


@pytest.mark.parametrize(
    "model",
    [
        "/etc",
        "/tmp/../etc",
        "../roots/org/base-model",
        "org/../../var",
        "~/models",
        "org\\base-model",
        "./org/base-model",
    ],
)
def test_a_job_never_names_a_server_path(trained: Trained, mclient: TestClient, model: str) -> None:
    fid = uploaded_id(mclient, trained.team)
    r = mclient.post(JOBS, headers=trained.team.headers, json={"model": model, "training_file": fid})
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == "model" and error_of(r)["code"] == "invalid_model"


def test_a_job_names_builtin_base_and_own_models_only(trained: Trained, mclient: TestClient) -> None:
    for team, model, status in [
        (trained.team, "org/base-model", 200),
        (trained.team, trained.checkpoints[0], 200),
        (trained.team, "gpt-17", 404),
        (trained.team, "org/missing", 404),
        (trained.other, trained.model, 404),
        (trained.other, trained.checkpoints[0], 404),
    ]:
        fid = uploaded_id(mclient, team)
        body = {"model": model, "training_file": fid, "hyperparameters": HYPER}
        r = mclient.post(JOBS, headers=team.headers, json=body)
        assert r.status_code == status, (model, r.text)
        if status == 404:
            assert error_of(r)["param"] == "model" and error_of(r)["code"] == "model_not_found"
        else:
            assert r.json()["model"] == model  # the job shows the id, never the folder


def test_a_job_continues_from_an_ft_checkpoint(
    trained: Trained, mclient: TestClient, msettings: Settings
) -> None:
    fid = uploaded_id(mclient, trained.team)
    ckpt = trained.checkpoints[-1]
    job = _run(
        mclient, msettings, trained.team, {"model": ckpt, "training_file": fid, "hyperparameters": HYPER}
    )
    assert job["model"] == ckpt
    # the base of the new ids is the original base model's, as OpenAI names models trained from ft: models
    assert job["fine_tuned_model"] == f"ft:tiny-llama:Models-Team::{job['id']}"
    no_adapter = _download(mclient, trained.team, job["fine_tuned_model"], format="adapter")
    assert no_adapter.status_code == 400 and error_of(no_adapter)["param"] == "format"


def test_a_checkpoint_recorded_again_gets_a_fresh_checksum(
    trained: Trained, mclient: TestClient, mapp: FastAPI
) -> None:
    """The writer may record a checkpoint again at the same path (a replayed report, a resumed run that
    rewrote it): the tar's mtimes follow the row, so the cached checksum must not outlive it."""
    import time

    from store.model_ids import register_checkpoint

    ckpt = trained.checkpoints[0]
    first = _download(mclient, trained.team, ckpt)
    assert first.headers["x-checksum-sha256"] == hashlib.sha256(first.content).hexdigest()
    with mapp.state.sessionmaker() as s:
        row = s.get(RegisteredModel, ckpt)
        assert row is not None and row.step_number is not None
        path, step = row.path, row.step_number
    time.sleep(1.1)  # tar mtimes have a resolution of one second
    with mapp.state.sessionmaker() as s:
        assert register_checkpoint(s, trained.job_id, step, path) == ckpt
        s.commit()
    second = _download(mclient, trained.team, ckpt)
    assert second.status_code == 200
    assert second.headers["x-checksum-sha256"] == hashlib.sha256(second.content).hexdigest()


def _server_path(mapp: FastAPI, model: str) -> Path:
    with mapp.state.sessionmaker() as s:
        row = s.get(RegisteredModel, model)
        assert row is not None
        return Path(row.path)


def test_download_resumes_with_range_and_head(trained: Trained, mclient: TestClient, tmp_path: Path) -> None:
    """The tar's bytes are fixed: HEAD gives its headers, Range GETs give its pieces (206), whose
    concatenation is the whole body; If-Range with the ETag or Last-Modified keeps a range, a stale one
    gets the whole body; a range past the end is 416; another team's HEAD and Range are 404."""
    full = _download(mclient, trained.team, trained.model)
    body, length = full.content, len(full.content)
    assert full.status_code == 200 and full.headers["accept-ranges"] == "bytes"
    etag, modified = full.headers["etag"], full.headers["last-modified"]

    head = mclient.head(f"/v1/models/{trained.model}/content", headers=trained.team.headers)
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["content-length"]) == length
    for name in ("x-checksum-sha256", "etag", "last-modified", "accept-ranges", "content-disposition"):
        assert head.headers[name] == full.headers[name], name

    cuts = [0, 1, 511, 512, 513, 10_000, length // 2, length - 1, length]
    parts = []
    for start, end in itertools.pairwise(cuts):
        r = _download(mclient, trained.team, trained.model, headers={"Range": f"bytes={start}-{end - 1}"})
        assert r.status_code == 206, r.text
        assert r.headers["content-range"] == f"bytes {start}-{end - 1}/{length}"
        assert int(r.headers["content-length"]) == len(r.content) == end - start
        assert (
            r.headers["etag"] == etag and r.headers["x-checksum-sha256"] == full.headers["x-checksum-sha256"]
        )
        parts.append(r.content)
    joined = b"".join(parts)
    assert joined == body and hashlib.sha256(joined).hexdigest() == full.headers["x-checksum-sha256"]
    with tarfile.open(fileobj=io.BytesIO(joined)) as tar:
        tar.extractall(tmp_path / "resumed", filter="data")
    server_side = _server_path(mclient.app, trained.model)  # type: ignore[arg-type]
    for f in (tmp_path / "resumed").iterdir():
        assert f.read_bytes() == (server_side / f.name).read_bytes(), f.name

    tail = _download(mclient, trained.team, trained.model, headers={"Range": "bytes=-100"})
    assert tail.status_code == 206 and tail.content == body[-100:]
    resumed = _download(mclient, trained.team, trained.model, headers={"Range": "bytes=1000-"})
    assert resumed.status_code == 206 and resumed.content == body[1000:]
    for validator in (etag, modified):
        kept = _download(
            mclient, trained.team, trained.model, headers={"Range": "bytes=1000-", "If-Range": validator}
        )
        assert kept.status_code == 206 and kept.content == body[1000:], validator
    stale = _download(
        mclient, trained.team, trained.model, headers={"Range": "bytes=1000-", "If-Range": '"stale"'}
    )
    assert stale.status_code == 200 and stale.content == body
    head_range = mclient.head(
        f"/v1/models/{trained.model}/content", headers={**trained.team.headers, "Range": "bytes=10-19"}
    )
    assert head_range.status_code == 206 and head_range.headers["content-length"] == "10"

    past = _download(mclient, trained.team, trained.model, headers={"Range": f"bytes={length}-"})
    assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{length}"
    assert error_of(past)["code"] == "range_not_satisfiable"

    for team_headers in (trained.other.headers, {}):
        h = mclient.head(f"/v1/models/{trained.model}/content", headers=team_headers)
        g = mclient.get(
            f"/v1/models/{trained.model}/content", headers={**team_headers, "Range": "bytes=0-99"}
        )
        assert h.status_code == g.status_code == (404 if team_headers else 401)
        assert h.content == b"" and b"PK" not in g.content and "content-range" not in g.headers


def test_a_multi_rank_checkpoint_downloads_the_model_only(
    trained: Trained, mclient: TestClient, mapp: FastAPI
) -> None:
    """A checkpoint of N ranks holds each rank's engine shard (pickles several times the model's size):
    neither a checkpoint's nor a final model's download carries them, nor the training state."""
    extra = ["engine-rank00000-of-00002.pt", "engine-rank00001-of-00002.pt", "training_state.pt", "rng.pth"]
    models = [trained.checkpoints[-1], trained.model]
    made: list[Path] = []
    try:
        for model in models:
            folder = _server_path(mapp, model)
            for name in extra:
                if not (folder / name).exists():
                    (folder / name).write_bytes(os.urandom(64 * 1024))
                    made.append(folder / name)
        for model in models:
            for fmt in ("model", "adapter"):
                r = _download(mclient, trained.team, model, format=fmt)
                assert r.status_code == 200, r.text
                with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
                    names = tar.getnames()
                assert names and not set(names) & {*extra, "zenflow_checkpoint.json"}, (model, fmt, names)
                assert not [n for n in names if n.endswith((".pt", ".pth", ".bin"))]
    finally:
        for f in made:
            f.unlink()


def test_events_of_a_finished_job_show_no_server_path(
    trained: Trained, mclient: TestClient, msettings: Settings
) -> None:
    """Events name the data by its file id, checkpoints and the base model by their public names:
    nothing under the data directory or a model root, in any message or data; no job or checkpoint
    object shows a path either."""
    fid = uploaded_id(mclient, trained.team)
    on_base = _run(
        mclient,
        msettings,
        trained.team,
        {"model": "org/base-model", "training_file": fid, "hyperparameters": HYPER},
    )
    roots = [msettings.data_dir, msettings.data_dir.resolve(), *msettings.model_roots]
    for job_id in (trained.job_id, on_base["id"]):
        job = mclient.get(f"{JOBS}/{job_id}", headers=trained.team.headers).json()
        events = mclient.get(f"{JOBS}/{job_id}/events", headers=trained.team.headers, params={"limit": 100})
        ckpts = mclient.get(f"{JOBS}/{job_id}/checkpoints", headers=trained.team.headers).json()["data"]
        shown = json.dumps([job, events.json(), ckpts])
        assert not [str(r) for r in roots if str(r) in shown], shown
        assert "output_dir" not in job and ckpts and all("path" not in c for c in ckpts)
        data = [e["data"] for e in events.json()["data"] if e.get("data")]
        assert {d["file_id"] for d in data if "file_id" in d} >= {job["training_file"]}
        saved = [d for d in data if set(d) == {"step", "path"}]
        assert saved and all(d["path"] == f"{job_id}/checkpoint-{d['step']:06d}" for d in saved), saved
    base_plan = [e for e in events.json()["data"] if (e.get("data") or {}).get("plan")]
    assert "org/base-model" in json.dumps(base_plan)


def test_delete(trained: Trained, mclient: TestClient, mapp: FastAPI, msettings: Settings) -> None:
    from store.model_ids import register_checkpoint
    from worker.job.runner import run_job_process

    h, other = trained.team.headers, trained.other.headers
    for base in ("tiny-llama", "org/base-model"):
        r = mclient.delete(f"/v1/models/{base}", headers=h)
        assert r.status_code == 403 and error_of(r)["code"] == "model_not_deletable"
    assert mclient.delete(f"/v1/models/{trained.model}", headers=other).status_code == 404

    # a checkpoint of a job that still runs stays: the job may resume from it
    fid = uploaded_id(mclient, trained.team)
    running = mclient.post(JOBS, headers=h, json={"model": "tiny-llama", "training_file": fid}).json()["id"]
    folder = msettings.resolved_jobs_dir / running / "checkpoint-000001"
    folder.mkdir(parents=True)
    with mapp.state.sessionmaker() as s:
        s.get(FineTuningJob, running).status = JobStatus.running.value
        live = register_checkpoint(s, running, 1, str(folder))
        s.commit()
    r = mclient.delete(f"/v1/models/{live}", headers=h)
    assert r.status_code == 409 and error_of(r)["code"] == "job_not_finished" and folder.is_dir()

    ckpt = trained.checkpoints[0]
    waiting = mclient.post(
        JOBS, headers=h, json={"model": ckpt, "training_file": fid, "hyperparameters": HYPER}
    )
    assert waiting.status_code == 200, waiting.text
    with mapp.state.sessionmaker() as s:
        path = Path(s.get(RegisteredModel, ckpt).path)
    r = mclient.delete(f"/v1/models/{ckpt}", headers=h)
    assert r.status_code == 200 and r.json() == {"id": ckpt, "object": "model", "deleted": True}
    assert not path.exists()
    assert mclient.get(f"/v1/models/{ckpt}", headers=h).status_code == 404
    assert ckpt not in {m["id"] for m in mclient.get("/v1/models", headers=h).json()["data"]}
    listed = mclient.get(f"{JOBS}/{trained.job_id}/checkpoints", headers=h).json()["data"]
    assert ckpt not in {c["fine_tuned_model_checkpoint"] for c in listed}
    assert mclient.delete(f"/v1/models/{ckpt}", headers=h).status_code == 404
    r = mclient.post(JOBS, headers=h, json={"model": ckpt, "training_file": fid})
    assert r.status_code == 404 and error_of(r)["param"] == "model"
    # a job created before the delete fails when it starts, naming the model
    assert run_job_process(waiting.json()["id"], settings=msettings) == 0
    failed = mclient.get(f"{JOBS}/{waiting.json()['id']}", headers=h).json()
    assert failed["status"] == "failed" and failed["error"]["code"] == "model_not_found"
    assert failed["error"]["param"] == "model" and ckpt in failed["error"]["message"]


def test_a_fresh_install_offers_the_demo_base_described(client: TestClient, team: TeamKey) -> None:
    """Default settings: the shipped base (trainer/samples/models) is listed, usable, with its card."""
    from trainer.samples import MODELS_DIR

    assert Settings(_env_file=None).model_roots == [MODELS_DIR]  # type: ignore[call-arg]
    listed = {m["id"]: m for m in client.get("/v1/models", headers=team.headers).json()["data"]}
    base = listed["docs-llama"]
    assert (base["kind"], base["usable"], base["owned_by"]) == ("base", True, "system")
    assert (
        base["description"].startswith("A small Llama (1.4M parameters") and "make run" in base["description"]
    )
    assert listed["small-llama"]["description"].startswith("Llama, 8 layers")


def test_a_description_is_the_cards_first_paragraph(tmp_path: Path) -> None:
    from api.model_names import MAX_DESCRIPTION, description_of

    assert description_of(tmp_path) is None  # no card
    (tmp_path / "README.md").write_text(
        "---\nlicense: mit\ntags: [x]\n---\n# Name\n\nFirst line\nwraps.\n\nMore.\n"
    )
    assert description_of(tmp_path) == "First line wraps."
    (tmp_path / "README.md").write_text("# Only a title\n")
    assert description_of(tmp_path) is None
    (tmp_path / "README.md").write_text("x" * 5000)
    assert len(description_of(tmp_path) or "") == MAX_DESCRIPTION

"""/v1/fine_tuning/jobs: create (validation, idempotency), list, retrieve, cancel, events (JSON, SSE),
checkpoints and per-step metrics."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from store.jobs import add_event, set_status
from store.orm import FineTuningJob, JobCheckpoint, JobEvent, JobStatus, JobStepMetric
from tests.api.conftest import Enqueued, TeamKey, error_of, uploaded_id

JOBS = "/v1/fine_tuning/jobs"


def create(client: TestClient, team: TeamKey, body: dict[str, Any], **headers: str) -> Any:
    return client.post(JOBS, headers={**team.headers, **headers}, json=body)


def _job_rows(app, team: TeamKey) -> int:  # type: ignore[no-untyped-def]
    with app.state.sessionmaker() as s:
        return s.scalar(
            select(func.count()).select_from(FineTuningJob).where(FineTuningJob.team_id == team.id)
        )


@pytest.fixture
def fid(client: TestClient, team: TeamKey) -> str:
    return uploaded_id(client, team)


def test_create_job_shape_and_enqueue(
    client: TestClient, team: TeamKey, fid: str, enqueued: Enqueued, settings
) -> None:  # type: ignore[no-untyped-def]
    r = create(
        client,
        team,
        {
            "model": "tiny-llama",
            "training_file": fid,
            "suffix": "demo",
            "seed": 7,
            "method": {
                "type": "supervised",
                "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 4}},
            },
            "metadata": {"owner": "ml"},
            "engine": {"mode": "zenflow", "topk_ratio": 0.05},
        },
    )
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["object"] == "fine_tuning.job" and job["id"].startswith("ftjob-")
    assert job["status"] == "queued" and job["organization_id"] == team.id and job["model"] == "tiny-llama"
    assert job["training_file"] == fid and job["validation_file"] is None and job["result_files"] == []
    hp = job["hyperparameters"]  # OpenAI's three first, resolved at create (tiny-llama's lr 3e-3, seed 7)
    assert list(hp.items())[:3] == [("n_epochs", 2), ("batch_size", 4), ("learning_rate_multiplier", 1.0)]
    assert (
        hp["learning_rate"] == 3e-3
        and hp["max_seq_length"] == 1024
        and hp["lora"] is None
        and hp["seed"] == 7
    )
    assert job["method"] == {"type": "supervised", "supervised": {"hyperparameters": job["hyperparameters"]}}
    assert job["seed"] == 7 and job["suffix"] == "demo" and job["user_provided_suffix"] == "demo"
    assert job["metadata"] == {"owner": "ml"} and job["integrations"] == [] and job["finished_at"] is None
    # the engine as resolved at create: every value concrete, with where it came from
    engine, sources = job["engine"], job["sources"]
    assert engine["mode"] == "zenflow" and engine["topk_ratio"] == 0.05 and engine["update_interval"] == 1
    assert sources["engine.mode"] == sources["engine.topk_ratio"] == "request"
    assert sources["engine.update_interval"] == "model" and sources["engine.eps"] == "default"
    assert sources["engine.accumulate_on"] == "default" and sources["hyperparameters.n_epochs"] == "request"
    assert (
        sources["hyperparameters.learning_rate"] == "model"
        and sources["hyperparameters.total_steps"] == "data"
    )
    assert {k for k in sources if k.startswith("engine.")} == {f"engine.{k}" for k in engine}
    (first,) = job["resolutions"]
    assert first["at"] == "create" and first["changes"] == {} and first["plan"].startswith("Plan: fits")
    assert job["queue_position"] >= 1 and job["error"] is None
    assert (job["id"], settings.default_queue) in enqueued.calls
    assert client.get(f"{JOBS}/{job['id']}", headers=team.headers).json()["id"] == job["id"]


@pytest.mark.parametrize(
    "engine",
    [
        {"mode": "auto"},
        {"accumulate_on": "auto"},
        {"mode": "auto", "accumulate_on": "auto", "topk_ratio": 0.2},
    ],
)
def test_engine_auto_is_accepted_at_create(
    client: TestClient, team: TeamKey, fid: str, engine: dict[str, Any]
) -> None:
    """``auto`` (documented, and the console's default choice) is resolved by the job's plan at create: the
    job object shows the value and the plan as its source, never ``auto``."""
    r = create(client, team, {"model": "tiny-llama", "training_file": fid, "engine": engine})
    assert r.status_code == 200, r.text
    job = r.json()
    for field, given in engine.items():
        assert job["engine"][field] == given if given != "auto" else job["engine"][field] != "auto"
        assert job["sources"][f"engine.{field}"] == ("request" if given != "auto" else "plan")
    assert "auto" not in job["engine"].values()


def test_an_engine_tuning_field_is_refused_naming_it(client: TestClient, team: TeamKey, fid: str) -> None:
    """The engine's internal knobs are each worker's tuning, not a job's: a create naming one is a 400
    naming it (and the settings a job may give), nothing written."""
    for field in ("cpu_chunk_elements", "bind_worker_cores", "landing_buffers"):
        r = create(client, team, {"model": "tiny-llama", "training_file": fid, "engine": {field: 1}})
        assert r.status_code == 400, r.text
        err = error_of(r)
        assert err["param"] == f"engine.{field}" and "not an engine setting a job may give" in err["message"]
        assert "topk_ratio" in err["message"] and "ZENFLOW_ENGINE_TUNING" in err["message"]
    assert client.get(JOBS, headers=team.headers).json()["data"] == []


def test_openapi_shows_the_engine_fields(client: TestClient) -> None:
    """The request body's ``engine`` is the contract's EngineRequest: its public fields, no worker tuning."""
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    engine = schemas["JobCreate"]["properties"]["engine"]
    ref = next(s["$ref"] for s in engine["anyOf"] if "$ref" in s).rsplit("/", 1)[-1]
    fields = schemas[ref]["properties"]
    assert {"mode", "accumulate_on", "topk_ratio", "update_interval", "select_interval"} <= set(fields)
    assert set(fields["mode"]["enum"]) == {"auto", "device", "offload", "zenflow"}
    assert not {"cpu_chunk_elements", "bind_worker_cores", "landing_buffers", "lr"} & set(fields)
    assert "the fastest mode that fits" in " ".join(fields["mode"]["description"].split())


def test_create_commits_then_enqueues_then_stamps_dispatched_at(
    client: TestClient,
    app,
    team: TeamKey,
    fid: str,  # type: ignore[no-untyped-def]
) -> None:
    """The outbox order: the row is committed (queued, not dispatched) before the enqueue, and
    dispatched_at is recorded after it; a crash in between leaves it to worker.dispatch."""
    seen: list[tuple[str, Any]] = []

    def probe(job_id: str, queue: str) -> None:
        with app.state.sessionmaker() as s:  # another session: only committed state is visible
            row = s.get(FineTuningJob, job_id)
            seen.append((row.status, row.dispatched_at))

    saved, app.state.enqueue = app.state.enqueue, probe
    try:
        r = create(client, team, {"model": "tiny-llama", "training_file": fid})
    finally:
        app.state.enqueue = saved
    assert r.status_code == 200, r.text
    assert seen == [("queued", None)]
    with app.state.sessionmaker() as s:
        assert s.get(FineTuningJob, r.json()["id"]).dispatched_at is not None


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"hyperparameters": {"n_epochs": -1}}, "hyperparameters.n_epochs", "invalid_value"),
        ({"hyperparameters": {"n_epochs": "many"}}, "hyperparameters.n_epochs", "invalid_value"),
        (
            {"hyperparameters": {"learning_rate_multiplier": 0}},
            "hyperparameters.learning_rate_multiplier",
            None,
        ),
        (
            {"method": {"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 0}}}},
            "method.supervised.hyperparameters.batch_size",
            None,
        ),
        (
            {"method": {"type": "reinforcement"}},
            "method.reinforcement",
            None,
        ),  # a reinforcement job needs its grader
        ({"hyperparameters": {"max_steps": 0}}, "hyperparameters.max_steps", None),
        (
            {
                "hyperparameters": {"n_epochs": 1},
                "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2}}},
            },
            "hyperparameters",
            None,
        ),
        (
            {"model": "/etc"},
            "model",
            "invalid_model",
        ),  # never a server path (unknown names: 404, test_models)
        ({"model": ""}, "model", None),
        ({"training_file": "file-doesnotexist"}, "training_file", "file_not_found"),
        ({"validation_file": "file-doesnotexist"}, "validation_file", "file_not_found"),
        ({"engine": {"topk_ratio": 2}}, "engine.topk_ratio", None),
        ({"engine": {"mode": "warp"}}, "engine.mode", None),
        ({"engine": {"update_interval": 4, "select_interval": 2}}, "engine.select_interval", None),
        ({"engine": {"lr": 0.1}}, "engine.lr", None),
        ({"engine": {"no_such_knob": 1}}, "engine.no_such_knob", None),
        ({"epochs": 3}, "epochs", None),
        ({"seed": -4}, "seed", None),
        ({"suffix": "x" * 65}, "suffix", None),
        ({"integrations": [{"type": "wandb"}]}, "integrations[0].wandb", "missing_required_parameter"),
        ({"integrations": [{"type": "comet"}]}, "integrations[0]", None),
        ({"training_file": None}, "training_file", None),
    ],
)
def test_bad_create_is_400_naming_the_field_and_writes_nothing(
    client: TestClient,
    app,
    team: TeamKey,
    fid: str,
    enqueued: Enqueued,  # type: ignore[no-untyped-def]
    body: dict[str, Any],
    param: str,
    code: str | None,
) -> None:
    calls = len(enqueued.calls)
    full = {"model": "tiny-llama", "training_file": fid, **body}
    r = create(client, team, full)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    if code:
        assert err["code"] == code
    assert _job_rows(app, team) == 0 and len(enqueued.calls) == calls


def test_missing_fields_and_bad_json(client: TestClient, team: TeamKey) -> None:
    r = create(client, team, {"training_file": "file-x"})
    assert r.status_code == 400 and error_of(r)["param"] == "model"
    assert error_of(r)["code"] == "missing_required_parameter"
    r = client.post(JOBS, headers={**team.headers, "Content-Type": "application/json"}, content=b"{nope")
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"


def test_other_teams_file_is_not_usable(client: TestClient, team: TeamKey, other_team: TeamKey) -> None:
    theirs = uploaded_id(client, other_team)
    r = create(client, team, {"model": "tiny-llama", "training_file": theirs})
    assert r.status_code == 400 and error_of(r)["param"] == "training_file"


def test_idempotent_create(client: TestClient, app, team: TeamKey, fid: str, enqueued: Enqueued) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "tiny-llama", "training_file": fid, "hyperparameters": {"n_epochs": 1}}
    a = create(client, team, body, **{"Idempotency-Key": "k-1"})
    calls = len(enqueued.calls)
    b = create(client, team, body, **{"Idempotency-Key": "k-1"})
    assert a.status_code == b.status_code == 200
    assert a.json()["id"] == b.json()["id"] and b.headers.get("idempotent-replayed") == "true"
    assert len(enqueued.calls) == calls and _job_rows(app, team) == 1

    c = create(client, team, {**body, "hyperparameters": {"n_epochs": 2}}, **{"Idempotency-Key": "k-1"})
    assert c.status_code == 409 and error_of(c)["code"] == "idempotency_key_reused"
    assert c.headers["x-should-retry"] == "false"
    d = create(client, team, body, **{"Idempotency-Key": "k-2"})
    assert d.status_code == 200 and d.json()["id"] != a.json()["id"]
    assert create(client, team, body).json()["id"] not in (a.json()["id"], d.json()["id"])
    assert _job_rows(app, team) == 3


def test_enqueue_failure_is_503_and_leaves_no_job(
    client: TestClient,
    app,
    team: TeamKey,
    fid: str,  # type: ignore[no-untyped-def]
    enqueued: Enqueued,
) -> None:
    enqueued.fail = True
    try:
        r = create(client, team, {"model": "tiny-llama", "training_file": fid})
    finally:
        enqueued.fail = False
    assert r.status_code == 503 and error_of(r)["code"] == "broker_unavailable"
    assert _job_rows(app, team) == 0


def test_list_jobs_paginates(client: TestClient, team: TeamKey, fid: str) -> None:
    ids = [create(client, team, {"model": "tiny-llama", "training_file": fid}).json()["id"] for _ in range(3)]
    p1 = client.get(JOBS, params={"limit": 2}, headers=team.headers).json()
    assert (
        p1["object"] == "list" and p1["has_more"] is True and [j["id"] for j in p1["data"]] == ids[::-1][:2]
    )
    p2 = client.get(JOBS, params={"limit": 2, "after": p1["data"][-1]["id"]}, headers=team.headers).json()
    assert [j["id"] for j in p2["data"]] == [ids[0]] and p2["has_more"] is False
    assert client.get(JOBS, params={"limit": 0}, headers=team.headers).status_code == 400
    assert error_of(client.get(JOBS, params={"limit": 0}, headers=team.headers))["param"] == "limit"


def _job(client: TestClient, team: TeamKey, fid: str) -> str:
    r = create(client, team, {"model": "tiny-llama", "training_file": fid})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _set(app, job_id: str, status: JobStatus, **cols: Any) -> None:  # type: ignore[no-untyped-def]
    with app.state.sessionmaker() as s:
        job = s.get(FineTuningJob, job_id)
        set_status(s, job, status)
        for k, v in cols.items():
            setattr(job, k, v)
        s.commit()


def test_cancel_queued_job(client: TestClient, team: TeamKey, fid: str) -> None:
    jid = _job(client, team, fid)
    r = client.post(f"{JOBS}/{jid}/cancel", headers=team.headers)
    assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.json()["finished_at"]
    assert r.json()["queue_position"] is None
    r = client.post(f"{JOBS}/{jid}/cancel", headers=team.headers)
    assert r.status_code == 409 and error_of(r)["code"] == "job_not_cancellable"


def test_cancel_running_job_sets_the_flag(client: TestClient, app, team: TeamKey, fid: str) -> None:  # type: ignore[no-untyped-def]
    jid = _job(client, team, fid)
    _set(app, jid, JobStatus.running, global_step=5, total_steps=10)
    r = client.post(f"{JOBS}/{jid}/cancel", headers=team.headers)
    job = r.json()
    assert r.status_code == 200 and job["status"] == "running" and job["cancel_requested"] is True
    assert job["progress"]["step"] == 5 and job["estimated_finish"] is not None
    with app.state.sessionmaker() as s:
        assert s.get(FineTuningJob, jid).cancel_requested is True
    # The worker acknowledges; a second cancel of a running job is a no-op.
    assert client.post(f"{JOBS}/{jid}/cancel", headers=team.headers).status_code == 200


def test_a_failed_jobs_error_shows_no_server_path(client: TestClient, app, team: TeamKey, fid: str) -> None:  # type: ignore[no-untyped-def]
    """The runner's error may quote a server folder (the model's, a file's); the job object names it
    as the API does (api.jobs.public_paths), in the one job and in the list."""
    jid = _job(client, team, fid)
    settings = app.state.settings
    data_dir = str(settings.data_dir.resolve())
    upload = f"{settings.resolved_files_dir}/{team.id}/{fid}.jsonl"
    message = f"model folder {data_dir}/models/acme: config.json is missing; data {upload} ok"
    _set(app, jid, JobStatus.failed, error={"code": "invalid_model", "message": message})
    one = client.get(f"{JOBS}/{jid}", headers=team.headers).json()
    listed = next(j for j in client.get(JOBS, headers=team.headers).json()["data"] if j["id"] == jid)
    for job in (one, listed):
        shown = job["error"]["message"]
        assert data_dir not in shown and str(settings.resolved_files_dir) not in shown, shown
        assert shown == f"model folder models/acme: config.json is missing; data {fid} ok"


def test_events_newest_first_paginated_and_streamed(client: TestClient, app, team: TeamKey, fid: str) -> None:  # type: ignore[no-untyped-def]
    jid = _job(client, team, fid)
    with app.state.sessionmaker() as s:
        for i in range(5):
            add_event(s, jid, f"step {i}", type="metrics", data={"step": i, "train_loss": 1.0 / (i + 1)})
        add_event(s, jid, "careful", level="warning")
        s.commit()
    ev = client.get(f"{JOBS}/{jid}/events", params={"limit": 3}, headers=team.headers).json()
    assert ev["object"] == "list" and ev["has_more"] is True
    assert [e["message"] for e in ev["data"]] == ["careful", "step 4", "step 3"]
    assert ev["data"][0]["level"] == "warn" and ev["data"][1]["type"] == "metrics"
    assert ev["data"][1]["object"] == "fine_tuning.job.event" and ev["data"][1]["data"]["step"] == 4
    rest = client.get(
        f"{JOBS}/{jid}/events", params={"after": ev["data"][-1]["id"], "limit": 100}, headers=team.headers
    ).json()
    assert [e["message"] for e in rest["data"]][:3] == ["step 2", "step 1", "step 0"]
    assert rest["data"][-1]["message"].startswith("Created fine-tuning job") and rest["has_more"] is False

    _set(app, jid, JobStatus.succeeded)
    with client.stream(
        "GET", f"{JOBS}/{jid}/events", params={"stream": "true"}, headers=team.headers
    ) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        body = "".join(resp.iter_text())
    datas = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    msgs = [json.loads(d)["message"] for d in datas[:-1]]
    assert msgs[0].startswith("Created fine-tuning job") and msgs[-1] == "Job succeeded" and "step 4" in msgs
    ids = [line[4:] for line in body.splitlines() if line.startswith("id: ")]
    # Resume after an id (Last-Event-ID, as EventSource does on reconnect).
    with client.stream(
        "GET",
        f"{JOBS}/{jid}/events",
        headers={**team.headers, "Accept": "text/event-stream", "Last-Event-ID": ids[-2]},
    ) as resp:
        tail = "".join(resp.iter_text())
    assert [line[6:] for line in tail.splitlines() if line.startswith("data: ")][-1] == "[DONE]"
    assert len([line for line in tail.splitlines() if line.startswith("id: ")]) == 1


def test_stream_follows_a_running_job(client: TestClient, app, team: TeamKey, fid: str) -> None:  # type: ignore[no-untyped-def]
    import threading
    import time

    jid = _job(client, team, fid)
    _set(app, jid, JobStatus.running)

    def worker() -> None:
        for i in range(3):
            time.sleep(0.1)
            with app.state.sessionmaker() as s:
                add_event(s, jid, f"tick {i}")
                s.commit()
        _set(app, jid, JobStatus.succeeded)

    t = threading.Thread(target=worker)
    t.start()
    with client.stream("GET", f"{JOBS}/{jid}/events?stream=true", headers=team.headers) as resp:
        body = "".join(resp.iter_text())
    t.join()
    datas = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    msgs = [json.loads(d)["message"] for d in datas[:-1]]
    assert [m for m in msgs if m.startswith("tick")] == ["tick 0", "tick 1", "tick 2"] and datas[
        -1
    ] == "[DONE]"


def test_checkpoints_and_metrics(client: TestClient, app, team: TeamKey, fid: str) -> None:  # type: ignore[no-untyped-def]
    jid = _job(client, team, fid)
    with app.state.sessionmaker() as s:
        for step in (10, 20, 30):
            s.add(
                JobCheckpoint(
                    job_id=jid,
                    step_number=step,
                    path=f"/x/step-{step}",
                    fine_tuned_model_checkpoint=f"ft:tiny-llama:{team.id}::{jid}:ckpt-step-{step}",
                    metrics={"train_loss": 2.0 - step / 100, "valid_loss": None},
                )
            )
        for step in range(1, 6):
            s.add(
                JobStepMetric(
                    job_id=jid,
                    step=step,
                    train_loss=1.0 / step,
                    step_seconds=0.2,
                    stall_seconds=0.02,
                    stall_fraction=0.1,
                    gpu_utilization=0.9,
                    cpu_optimizer_seconds=0.05,
                    bytes_device_to_host=100,
                    bytes_host_to_device=50,
                )
            )
        s.commit()
    ck = client.get(f"{JOBS}/{jid}/checkpoints", params={"limit": 2}, headers=team.headers).json()
    assert [c["step_number"] for c in ck["data"]] == [30, 20] and ck["has_more"] is True
    c = ck["data"][0]
    assert c["object"] == "fine_tuning.job.checkpoint" and c["fine_tuning_job_id"] == jid
    assert c["metrics"]["step"] == 30 and c["metrics"]["train_loss"] == pytest.approx(1.7)
    ck2 = client.get(
        f"{JOBS}/{jid}/checkpoints", params={"after": ck["last_id"]}, headers=team.headers
    ).json()
    assert [c["step_number"] for c in ck2["data"]] == [10] and ck2["has_more"] is False

    m = client.get(f"{JOBS}/{jid}/metrics", params={"limit": 3}, headers=team.headers).json()
    assert [x["step"] for x in m["data"]] == [1, 2, 3] and m["has_more"] is True
    assert m["data"][0]["stall_fraction"] == 0.1 and m["data"][0]["gpu_utilization"] == 0.9
    m2 = client.get(f"{JOBS}/{jid}/metrics", params={"after": m["last_id"]}, headers=team.headers).json()
    assert [x["step"] for x in m2["data"]] == [4, 5]


def test_failed_job_error_object(client: TestClient, app, team: TeamKey, fid: str) -> None:  # type: ignore[no-untyped-def]
    jid = _job(client, team, fid)
    with app.state.sessionmaker() as s:
        job = s.get(FineTuningJob, jid)
        set_status(
            s,
            job,
            JobStatus.failed,
            error={"code": "invalid_training_file", "message": "too long", "param": "training_file"},
        )
        s.commit()
    job = client.get(f"{JOBS}/{jid}", headers=team.headers).json()
    assert job["status"] == "failed" and job["error"] == {
        "code": "invalid_training_file",
        "message": "too long",
        "param": "training_file",
    }
    with app.state.sessionmaker() as s:
        assert s.scalar(select(func.count()).select_from(JobEvent).where(JobEvent.job_id == jid)) >= 3

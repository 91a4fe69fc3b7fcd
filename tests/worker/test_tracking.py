"""Tracking integrations of a real job (the job runner in-process against the real PostgreSQL): a real
``mlflow server`` (SQLite backend) started here receives the run's params, every step's metrics, the
checkpoints' and the final model's ids; the same job's W&B run is written offline under its output;
a tracking server that is down (MLflow, W&B online) leaves the job succeeded with a warning event and
the metrics in the job's output folder; one away at first and back before the end gets every step;
a resumed job logs to its earlier MLflow run."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from store.db import session_scope
from store.orm import JobCheckpoint, JobEvent
from store.settings import Settings
from tests.mlflow_server import running_mlflow_server
from tests.worker import wandb_records
from tests.worker.test_worker import get_job, make_job, sums_file
from trainer.run.launch import free_port
from worker.tracking.base import STEP_METRICS

pytestmark = [pytest.mark.usefixtures("torch_single_thread"), pytest.mark.slow]

#: Environment the sinks set in the job process (here: the test process), restored after each test.
_SINK_ENV = (
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "WANDB_DIR",
    "WANDB_SILENT",
    "WANDB_MODE",
    "WANDB_CONSOLE",
    "WANDB_DISABLE_GIT",
    "WANDB_BASE_URL",
    "WANDB_API_KEY",
)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


@pytest.fixture
def tracking_env(service_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for k in _SINK_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the internet, whatever a sink decides
    monkeypatch.setenv("WANDB_SILENT", "true")
    return monkeypatch


def _settings(monkeypatch: pytest.MonkeyPatch, **env: str) -> Settings:
    from store.settings import get_settings

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    return get_settings()


def _events(url: str, job_id: str, level: str) -> list[tuple[str, dict[str, Any]]]:
    with session_scope(url) as s:
        rows = s.execute(
            select(JobEvent.message, JobEvent.data)
            .where(JobEvent.job_id == job_id, JobEvent.level == level)
            .order_by(JobEvent.seq)
        ).all()
        return [(m, dict(d or {})) for m, d in rows]


def _checkpoint_ids(url: str, job_id: str) -> dict[int, str]:
    with session_scope(url) as s:
        rows = s.scalars(select(JobCheckpoint).where(JobCheckpoint.job_id == job_id)).all()
        return {c.step_number: str(c.fine_tuned_model_checkpoint) for c in rows}


def test_mlflow_and_wandb_runs_of_a_job(
    mlflow_server: str, tracking_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    from worker.job.runner import run_job_process

    settings = _settings(
        tracking_env,
        ZENFLOW_MLFLOW_TRACKING_URI=mlflow_server,
        # the server answers; on a loaded box a request may take longer than the 5 s default
        ZENFLOW_TRACKING_REQUEST_TIMEOUT_SECONDS="120",
    )
    url = settings.resolved_database_url
    experiment = f"zf-test-{secrets.token_hex(4)}"
    integrations = [
        {"type": "mlflow", "mlflow": {"experiment": experiment, "run_name": "tiny", "tags": {"owner": "ml"}}},
        {"type": "wandb", "wandb": {"project": "zf-test", "name": "tiny-wb", "tags": ["ci"]}},
    ]
    job_id = make_job(
        url,
        sums_file(tmp_path / "d.jsonl", n=24),
        hyperparameters={"checkpoint_every": 3},
        integrations=integrations,
    )
    assert run_job_process(job_id) == 0
    job = get_job(url, job_id)
    assert job.status == "succeeded" and job.total_steps == 6, _events(url, job_id, "error")
    assert _events(url, job_id, "warning") == []
    steps = list(range(1, job.total_steps + 1))

    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    params = run.data.params
    assert params["job_id"] == job_id and params["model"] == "tiny-llama" and params["seed"] == "1"
    assert json.loads(params["hyperparameters"])["checkpoint_every"] == 3
    assert params["hp.batch_size"] == "4" and params["hp.total_steps"] == "6"
    assert params["run.engine_mode"] == "device" and params["run.num_examples"] == "24"
    counts = {}
    for key in STEP_METRICS:
        history = client.get_metric_history(run.info.run_id, key)
        counts[key] = len(history)
        assert sorted(m.step for m in history) == steps, key
    print(f"MLflow run {run.info.run_id}: metric points per key {counts}; job steps {job.total_steps}")
    losses = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train_loss")}
    assert all(v > 0 for v in losses.values())
    tags = run.data.tags
    assert tags["owner"] == "ml" and tags["zenflow.job_id"] == job_id
    assert tags["zenflow.fine_tuned_model"] == job.fine_tuned_model
    ckpt_tags = {int(k.rsplit(".", 1)[1]): v for k, v in tags.items() if k.startswith("zenflow.checkpoint.")}
    assert (
        ckpt_tags
        == _checkpoint_ids(url, job_id)
        == {
            3: f"{job.fine_tuned_model}:ckpt-step-3",
            6: f"{job.fine_tuned_model}:ckpt-step-6",
        }
    )

    # W&B: no key configured -> the offline format under the job's output, holding every step.
    (wb_file,) = (Path(str(job.output_dir)) / "tracking" / "wandb").glob("offline-run-*/run-*.wandb")
    rows = [r for r in wandb_records.history(wb_file) if "train_loss" in r]
    assert [r["_step"] for r in rows] == steps
    assert [r["train_loss"] for r in rows] == pytest.approx([losses[s] for s in steps])
    assert all(set(STEP_METRICS) <= set(r) for r in rows)
    summary = wandb_records.summary(wb_file)
    assert summary["fine_tuned_model"] == job.fine_tuned_model
    assert summary["checkpoint.6"] == f"{job.fine_tuned_model}:ckpt-step-6"
    rec = wandb_records.run_record(wb_file)
    assert rec.project == "zf-test" and rec.display_name == "tiny-wb" and list(rec.tags) == ["ci"]


def test_a_tracking_server_that_is_down_never_fails_the_job(
    tracking_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from worker.job.runner import run_job_process

    nobody = f"http://127.0.0.1:{free_port()}"  # a port nobody listens on
    settings = _settings(
        tracking_env,
        ZENFLOW_MLFLOW_TRACKING_URI=nobody,
        ZENFLOW_WANDB_BASE_URL=f"http://127.0.0.1:{free_port()}",  # W&B online, its server away too
        ZENFLOW_WANDB_API_KEY="k" * 40,
        ZENFLOW_TRACKING_REQUEST_TIMEOUT_SECONDS="1",  # wandb.init gives up after 6 s
        ZENFLOW_TRACKING_CLOSE_SECONDS="2",
        ZENFLOW_TRACKING_FLUSH_SECONDS="0.5",
    )
    url = settings.resolved_database_url
    job_id = make_job(
        url,
        sums_file(tmp_path / "d.jsonl", n=16),
        integrations=[
            {"type": "mlflow", "mlflow": {"experiment": "down"}},
            {"type": "wandb", "wandb": {"project": "down"}},
        ],
    )
    assert run_job_process(job_id) == 0
    job = get_job(url, job_id)
    assert job.status == "succeeded" and job.fine_tuned_model, _events(url, job_id, "error")
    steps = list(range(1, int(job.total_steps or 0) + 1))
    every = _events(url, job_id, "warning")
    [(wb_warning, _)] = [(m, d) for m, d in every if d.get("tracking") == "wandb"]
    assert wb_warning.startswith("W&B server unreachable (CommError); the run is written offline"), every
    (wb_file,) = (Path(str(job.output_dir)) / "tracking" / "wandb").glob("offline-run-*/run-*.wandb")
    assert [r["_step"] for r in wandb_records.history(wb_file) if "train_loss" in r] == steps
    warnings = [(m, d) for m, d in every if d.get("tracking") == "mlflow"]
    assert warnings[0][0].startswith("MLflow tracking server unreachable"), warnings
    unsent = Path(str(job.output_dir)) / "tracking" / "mlflow-unsent.jsonl"
    assert str(unsent) in warnings[-1][0] and warnings[-1][1]["metrics"] > 0, warnings
    lines = [json.loads(line) for line in unsent.read_text().splitlines()]
    assert lines[0]["run"]["experiment"] == "down" and lines[0]["run"]["run_id"] is None
    losses = sorted(x["step"] for x in lines if x.get("metric") == "train_loss")
    assert losses == steps
    params = {x["param"]: x["value"] for x in lines if "param" in x}
    assert params["job_id"] == job_id and params["hp.batch_size"] == "4"
    tags = {x["tag"]: x["value"] for x in lines if "tag" in x}
    assert tags["zenflow.fine_tuned_model"] == job.fine_tuned_model
    # the job's messages stay the job's: the success is the last event
    with session_scope(url) as s:
        last = s.scalars(
            select(JobEvent.message).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)
        ).all()
    assert last[-1].startswith("Job succeeded")


def test_metrics_kept_while_the_server_is_away_are_sent_when_it_is_back(
    mlflow_server: str, tracking_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    from tests.worker.tcp_relay import TcpRelay
    from worker.job.runner import run_job_process

    relay = TcpRelay(int(mlflow_server.rsplit(":", 1)[1]))  # refuses connections until opened
    settings = _settings(
        tracking_env,
        ZENFLOW_MLFLOW_TRACKING_URI=relay.uri,
        ZENFLOW_TRACKING_FLUSH_SECONDS="0.5",
        ZENFLOW_TRACKING_CLOSE_SECONDS="120",  # the job's end waits for the server within this
    )
    url = settings.resolved_database_url
    experiment = f"zf-back-{secrets.token_hex(4)}"
    job_id = make_job(
        url,
        sums_file(tmp_path / "d.jsonl", n=16),
        integrations=[{"type": "mlflow", "mlflow": {"experiment": experiment}}],
    )
    stop = threading.Event()

    def open_when_warned() -> None:  # the server comes back once the job has said it was away
        while not stop.is_set():
            if _events(url, job_id, "warning"):
                relay.open()
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=open_when_warned, daemon=True)
    watcher.start()
    try:
        assert run_job_process(job_id) == 0
    finally:
        stop.set()
        watcher.join()
        relay.close()
    job = get_job(url, job_id)
    assert job.status == "succeeded", _events(url, job_id, "error")
    messages = [m for m, _ in _events(url, job_id, "warning")]
    assert messages[0].startswith("MLflow tracking server unreachable"), messages
    assert messages[-1].startswith("MLflow tracking server reachable again"), messages
    assert not (Path(str(job.output_dir)) / "tracking" / "mlflow-unsent.jsonl").exists()
    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["zenflow.fine_tuned_model"] == job.fine_tuned_model
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert sorted(m.step for m in history) == list(range(1, int(job.total_steps or 0) + 1))


def test_a_resumed_job_logs_to_its_earlier_mlflow_run(
    mlflow_server: str, tracking_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    from worker.job.runner import run_job_process

    settings = _settings(tracking_env, ZENFLOW_MLFLOW_TRACKING_URI=mlflow_server)
    url = settings.resolved_database_url
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = f"zf-resume-{secrets.token_hex(4)}"
    exp_id = client.create_experiment(experiment)
    earlier = client.create_run(exp_id, run_name="earlier").info.run_id  # the job's first attempt
    client.log_param(earlier, "run.device", "cuda:7")  # logged on the worker it ran on then
    client.set_terminated(earlier, "FAILED")
    out = tmp_path / "out"
    (out / "tracking").mkdir(parents=True)
    (out / "tracking" / "mlflow-run-id").write_text(earlier)
    job_id = make_job(
        url,
        sums_file(tmp_path / "d.jsonl", n=16),
        integrations=[{"type": "mlflow", "mlflow": {"experiment": experiment}}],
        output_dir=str(out),
    )
    assert run_job_process(job_id) == 0
    job = get_job(url, job_id)
    assert job.status == "succeeded", _events(url, job_id, "error")
    (run,) = client.search_runs([exp_id])
    assert run.info.run_id == earlier and run.info.status == "FINISHED"
    assert run.data.params["run.device"] == "cuda:7" and run.data.params["hp.batch_size"] == "4"
    history = client.get_metric_history(earlier, "train_loss")
    assert sorted(m.step for m in history) == list(range(1, int(job.total_steps or 0) + 1))
    [(message, data)] = _events(url, job_id, "warning")
    assert message.startswith("MLflow refused the params run.device ") and data["params"] == ["run.device"]

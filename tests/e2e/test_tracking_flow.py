"""A job created with the official openai SDK with ``integrations`` runs on a real Celery worker (real
PostgreSQL, Redis) and its run is on a real MLflow server: the SDK's job shows the integration, and the
MLflow run has one point per step of every step metric and the final model's id."""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from store.settings import Settings
from tests.api.conftest import TEST_API_SETTINGS, ServerThread, make_team
from tests.e2e.test_full_flow import running_worker
from tests.mlflow_server import running_mlflow_server
from worker.tracking.base import STEP_METRICS

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture
def flow_settings(settings: Settings, tmp_path: Path) -> Iterator[Settings]:
    import redis

    queue = f"zf-test-tracking-{secrets.token_hex(4)}"
    yield settings.model_copy(update={"default_queue": queue, "data_dir": tmp_path / "var"})
    r = redis.Redis.from_url(settings.broker_url)
    for key in r.scan_iter(f"*{queue}*"):
        r.delete(key)


@pytest.fixture
def mlflow_uri(tmp_path: Path) -> Iterator[str]:
    folder = tmp_path / "mlflow"
    folder.mkdir()
    with running_mlflow_server(folder) as uri:
        yield uri


@contextlib.contextmanager
def celery_worker(
    flow_settings: Settings, mlflow_uri: str, tmp_path: Path
) -> Iterator[subprocess.Popen[bytes]]:
    with running_worker(
        flow_settings,
        tmp_path,
        "tracking",
        ZENFLOW_MLFLOW_TRACKING_URI=mlflow_uri,
        WANDB_MODE="offline",
        # the server is up throughout: no request may count it as down because a loaded box (the CI hog)
        # answered one slower than the product's 5 s
        ZENFLOW_TRACKING_REQUEST_TIMEOUT_SECONDS="120",
    ) as proc:
        yield proc


def test_sdk_job_with_mlflow_integration_runs_into_the_tracking_server(
    flow_settings: Settings, mlflow_uri: str, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    from api.app import create_app
    from trainer.samples import TRAIN_FILE
    from worker.broker import configure_celery

    configure_celery(flow_settings)
    app = create_app(flow_settings, TEST_API_SETTINGS)
    team = make_team(app)
    experiment = f"zf-sdk-{secrets.token_hex(4)}"
    try:
        with ServerThread(app) as server:
            sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=team.key, max_retries=0, timeout=60)
            with TRAIN_FILE.open("rb") as f:
                fid = sdk.files.create(file=f, purpose="fine-tune").id
            job = sdk.fine_tuning.jobs.create(
                model="tiny-llama",
                training_file=fid,
                seed=3,
                hyperparameters={"n_epochs": 1, "batch_size": 16},
                integrations=[
                    {"type": "mlflow", "mlflow": {"experiment": experiment, "run_name": "sdk"}}  # type: ignore[list-item, typeddict-item]
                ],
            )
            assert job.integrations is not None and job.integrations[0].type == "mlflow"  # type: ignore[comparison-overlap]
            with celery_worker(flow_settings, mlflow_uri, tmp_path):
                deadline = time.monotonic() + 600
                while job.status not in ("succeeded", "failed", "cancelled") and time.monotonic() < deadline:
                    time.sleep(1)
                    job = sdk.fine_tuning.jobs.retrieve(job.id)
            events = [e.message for e in sdk.fine_tuning.jobs.list_events(job.id, limit=100).data]
            assert job.status == "succeeded", (events, (tmp_path / "worker.log").read_text()[-3000:])
            steps = sdk.get(f"/fine_tuning/jobs/{job.id}", cast_to=object)["progress"]["total_steps"]  # type: ignore[index]
            assert not [m for m in events if "MLflow" in m], events
    finally:
        configure_celery()
        app.state.engine.dispose()

    client = MlflowClient(tracking_uri=mlflow_uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "sdk" and run.info.status == "FINISHED"
    assert run.data.tags["zenflow.fine_tuned_model"] == job.fine_tuned_model
    assert run.data.params["job_id"] == job.id and run.data.params["hp.batch_size"] == "16"
    counts = {k: len(client.get_metric_history(run.info.run_id, k)) for k in STEP_METRICS}
    print(f"MLflow run of {job.id}: points per metric {counts}; the job's steps {steps}")
    assert counts == dict.fromkeys(STEP_METRICS, steps)

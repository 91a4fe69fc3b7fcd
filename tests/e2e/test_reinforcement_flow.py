"""Reinforcement fine-tuning through the official ``openai`` SDK against a live API, a real Celery worker
and job runner (issue 38's must-show): the grader endpoints (string_check scores a right and a wrong
sample 1 and 0; a Python grader that opens a TCP connection to the API's own port, or reads the
server's environment, scores 0; one that loops forever is stopped with its runtime flag), then a
reinforcement job on the demo base (docs-llama) whose grader checks that the completion uses the word
the prompt names (trainer/samples/keyword_rl_*.jsonl), its rewards in the job's events (every step's,
the evaluations' from before the first step to the end, the graded samples), the worker's Prometheus
metrics and the job's MLflow run.

The job runs ``ZENFLOW_E2E_RL_EPOCHS`` epochs of 3 steps (default 4: what CI affords under load); at 40
(120 steps, about 3 minutes on a quiet 2-core box) the test also asks the mean validation reward to rise
by at least 0.3 from its first evaluation to its last, as the issue's must-show does (it rose 0.00 ->
0.44 here); tests/trainer/method/test_keyword_learning.py checks a shorter run's rise in every CI."""

from __future__ import annotations

import os
import secrets
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from store.settings import Settings
from tests.api.conftest import TEST_API_SETTINGS, ServerThread, make_team
from tests.e2e.test_full_flow import running_worker
from tests.e2e.test_tracking_flow import flow_settings, mlflow_uri
from trainer.samples import KEYWORD_GRADER

__all__ = ["flow_settings", "mlflow_uri"]

SAMPLES = Path(__file__).resolve().parents[2] / "trainer" / "samples"
pytestmark = pytest.mark.slow
#: Epochs of the job (3 steps each; see the module doc).
EPOCHS = int(os.environ.get("ZENFLOW_E2E_RL_EPOCHS", "4"))


def _python_grader(source: str) -> dict[str, Any]:
    return {"type": "python", "name": "probe", "source": source}


def _check_graders(sdk: openai.OpenAI, api_port: int) -> None:
    graders = sdk.fine_tuning.alpha.graders
    assert graders.validate(grader=KEYWORD_GRADER).grader is not None  # type: ignore[arg-type]
    item = {"keyword": "value"}
    right = graders.run(grader=KEYWORD_GRADER, model_sample="It has a Value.", item=item)  # type: ignore[arg-type]
    wrong = graders.run(grader=KEYWORD_GRADER, model_sample="It has a file.", item=item)  # type: ignore[arg-type]
    assert (right.reward, wrong.reward) == (1.0, 0.0)
    connect = (
        "import socket\n"
        "def grade(sample, item):\n"
        f"    socket.create_connection(('127.0.0.1', {api_port}), timeout=5).close()\n"
        "    return 1.0\n"
    )
    net = graders.run(grader=_python_grader(connect), model_sample="x", item={})  # type: ignore[arg-type]
    assert net.reward == 0.0 and net.metadata.errors.python_grader_runtime_error, net
    os.environ["ZENFLOW_E2E_SECRET"] = secret = secrets.token_hex(8)
    env = f"import os\ndef grade(sample, item):\n    return float('{secret}' in str(dict(os.environ)))\n"
    seen = graders.run(grader=_python_grader(env), model_sample="x", item={})  # type: ignore[arg-type]
    assert seen.reward == 0.0, seen
    t0 = time.monotonic()
    loop = graders.run(
        grader=_python_grader("def grade(sample, item):\n    while True: pass\n"), model_sample="x", item={}
    )  # type: ignore[arg-type]
    assert loop.reward == 0.0 and loop.metadata.errors.python_grader_runtime_error, loop
    assert time.monotonic() - t0 < 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return str(r.read().decode())


def _wait(sdk: openai.OpenAI, job_id: str, seconds: float, metrics_port: int) -> tuple[Any, str]:
    """The job once it ended, and the worker's /metrics as last scraped while it trained with a step's
    rewards in (the job's gauges are cleared when it ends)."""
    deadline, scraped = time.monotonic() + seconds, ""
    job = sdk.fine_tuning.jobs.retrieve(job_id)
    while job.status not in ("succeeded", "failed", "cancelled") and time.monotonic() < deadline:
        time.sleep(1)
        step = sdk.get(f"/fine_tuning/jobs/{job_id}", cast_to=object)["progress"]["step"]  # type: ignore[index]
        if step >= 1 and "\nzenflow_rft_reward_mean{" in (now := _scrape(metrics_port)):
            scraped = now
        job = sdk.fine_tuning.jobs.retrieve(job_id)
    return job, scraped


def _upload(sdk: openai.OpenAI, name: str) -> str:
    with (SAMPLES / name).open("rb") as f:
        return sdk.files.create(file=f, purpose="fine-tune").id


def test_reinforcement_job_through_the_sdk_learns_and_is_seen(
    flow_settings: Settings, mlflow_uri: str, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    from api.app import create_app
    from worker.broker import configure_celery

    configure_celery(flow_settings)
    app = create_app(flow_settings, TEST_API_SETTINGS)
    team = make_team(app)
    experiment, metrics_port = f"zf-rl-{secrets.token_hex(4)}", _free_port()
    try:
        with ServerThread(app) as server:
            sdk = openai.OpenAI(
                base_url=f"{server.base_url}/v1", api_key=team.key, max_retries=0, timeout=120
            )
            _check_graders(sdk, int(server.base_url.rsplit(":", 1)[1]))
            train, valid = _upload(sdk, "keyword_rl_train.jsonl"), _upload(sdk, "keyword_rl_valid.jsonl")
            job = sdk.fine_tuning.jobs.create(
                model="docs-llama",
                training_file=train,
                validation_file=valid,
                seed=0,
                method={
                    "type": "reinforcement",
                    "reinforcement": {
                        "grader": KEYWORD_GRADER,  # type: ignore[typeddict-item]
                        "hyperparameters": {
                            "n_epochs": EPOCHS,
                            "batch_size": 8,
                            "eval_interval": max(1, EPOCHS),
                            "max_completion_tokens": 24,  # type: ignore[typeddict-unknown-key]
                            "max_seq_length": 128,
                        },
                    },
                },
                integrations=[{"type": "mlflow", "mlflow": {"experiment": experiment}}],  # type: ignore[list-item, typeddict-item]
            )
            assert job.method is not None and job.method.type == "reinforcement"
            with running_worker(
                flow_settings,
                tmp_path,
                "rl",
                ZENFLOW_MLFLOW_TRACKING_URI=mlflow_uri,
                ZENFLOW_WORKER_METRICS_PORT=str(metrics_port),
                ZENFLOW_TRACKING_REQUEST_TIMEOUT_SECONDS="120",
            ):
                job, scraped = _wait(sdk, job.id, 1500, metrics_port)
            events = sdk.fine_tuning.jobs.list_events(job.id, limit=1000).data
            assert job.status == "succeeded", (
                [e.message for e in events][:40],
                (tmp_path / "worker.log").read_text()[-4000:],
            )
    finally:
        configure_celery()
        app.state.engine.dispose()

    evals = sorted(
        (e.data["step"], e.data["valid_reward_mean"])  # type: ignore[index]
        for e in events
        if e.data and "valid_reward_mean" in e.data  # type: ignore[operator]
    )
    print(f"validation reward by step: {evals}")
    total = job.hyperparameters.model_extra["total_steps"]  # type: ignore[index]
    assert evals[0][0] == 0 and evals[-1][0] == total, evals  # the base's, ..., the end's
    if EPOCHS >= 40:
        assert evals[-1][1] - evals[0][1] >= 0.3, evals
    steps = [e for e in events if e.data and "reward_mean" in e.data]  # type: ignore[operator]
    assert len(steps) == total, len(steps)
    shown = [e for e in events if e.data and "samples" in e.data]  # type: ignore[operator]
    assert shown and all("completion" in x and "reward" in x for x in shown[0].data["samples"]), shown  # type: ignore[index]
    for family in (
        "zenflow_rft_reward_mean",
        "zenflow_rft_valid_reward_mean",
        "zenflow_rft_generation_seconds_total",
    ):
        assert f"\n{family}{{" in scraped, scraped[-3000:]

    client = MlflowClient(tracking_uri=mlflow_uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    (run,) = client.search_runs([exp.experiment_id])
    history = client.get_metric_history(run.info.run_id, "rft_reward_mean")
    assert len(history) == len(steps)
    assert client.get_metric_history(run.info.run_id, "rft_valid_reward_mean")

"""A reinforcement job whose grader asks a model (issue 38: ``score_model`` judged through our own serving
layer), as deployed: the serving process (``python -m serving``), a live API that sends chat there, and a
real Celery worker that knows the serving process from its settings. Through the ``openai`` SDK: the
grader runs on one sample (``graders.run``), then a job on tiny-llama graded by a ``multi`` of the
keyword check and a tiny-llama judge trains to the end; every step's rewards carry the judge's
sub-reward with no ``model_grader_server_error``, and the serving process answered a chat request per
completion judged (its ``zenflow_inference_requests_total``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import SecretStr

from store.settings import Settings
from tests.api.conftest import TEST_API_SETTINGS, ServerThread, free_port, make_team
from tests.e2e.test_full_flow import running_worker
from tests.e2e.test_tracking_flow import flow_settings
from tests.serving.test_serving_process import TOKEN, chat_requests_answered, serving_process
from trainer.samples import KEYWORD_GRADER, KEYWORD_TRAIN_FILE

__all__ = ["flow_settings"]

pytestmark = pytest.mark.slow
JUDGE = {
    "type": "score_model",
    "name": "judge",
    "model": "tiny-llama",
    "input": [{"role": "user", "content": "Does '{{sample.output_text}}' use '{{item.keyword}}'? 0 or 1."}],
    "range": [0, 1],
    "sampling_params": {"max_completions_tokens": 6},
}
GRADER = {
    "type": "multi",
    "name": "keyword and judge",
    "graders": {"keyword": KEYWORD_GRADER, "judge": JUDGE},
    "calculate_output": "0.5 * keyword + 0.5 * judge",
}
#: Prompts per step and completions per prompt (compute_multiplier 0.25 x 8), prompts trained on.
BATCH, SAMPLES, PROMPTS = 4, 2, 8


def _upload(sdk: openai.OpenAI, tmp_path: Path, rows: list[str]) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(rows))
    with path.open("rb") as f:
        return sdk.files.create(file=f, purpose="fine-tune").id


def _wait(sdk: openai.OpenAI, job_id: str, seconds: float) -> Any:
    deadline = time.monotonic() + seconds
    job = sdk.fine_tuning.jobs.retrieve(job_id)
    while job.status not in ("succeeded", "failed", "cancelled") and time.monotonic() < deadline:
        time.sleep(1)
        job = sdk.fine_tuning.jobs.retrieve(job_id)
    return job


def test_a_jobs_model_grader_is_judged_by_the_serving_process(
    flow_settings: Settings, tmp_path: Path
) -> None:
    from api.app import create_app
    from worker.broker import configure_celery

    port = free_port()
    serving_url = f"http://127.0.0.1:{port}"
    configure_celery(flow_settings)
    api_settings = TEST_API_SETTINGS.model_copy(
        update={"inference_server_url": serving_url, "inference_server_token": SecretStr(TOKEN)}
    )
    app = create_app(flow_settings, api_settings)
    team = make_team(app)
    rows = KEYWORD_TRAIN_FILE.read_text().splitlines(keepends=True)[:PROMPTS]
    try:
        with serving_process(port), ServerThread(app) as server:
            sdk = openai.OpenAI(
                base_url=f"{server.base_url}/v1", api_key=team.key, max_retries=0, timeout=120
            )
            ran = sdk.fine_tuning.alpha.graders.run(
                grader=JUDGE,  # type: ignore[arg-type]
                model_sample="a value",
                item={"keyword": "value"},
            )
            assert not ran.metadata.errors.model_grader_server_error, ran
            assert ran.metadata.sampled_model_name == "tiny-llama" and 0.0 <= ran.reward <= 1.0
            before = chat_requests_answered(serving_url)
            job = sdk.fine_tuning.jobs.create(
                model="tiny-llama",
                training_file=_upload(sdk, tmp_path, rows),
                seed=0,
                method={
                    "type": "reinforcement",
                    "reinforcement": {
                        "grader": GRADER,  # type: ignore[typeddict-item]
                        "hyperparameters": {
                            "n_epochs": 1,
                            "batch_size": BATCH,
                            "compute_multiplier": 0.25,
                            "max_completion_tokens": 8,  # type: ignore[typeddict-unknown-key]
                            "max_seq_length": 96,
                        },
                    },
                },
            )
            with running_worker(
                flow_settings,
                tmp_path,
                "judge",
                ZENFLOW_API_INFERENCE_SERVER_URL=serving_url,
                ZENFLOW_API_INFERENCE_SERVER_TOKEN=TOKEN,
            ):
                job = _wait(sdk, job.id, 900)
            events = sdk.fine_tuning.jobs.list_events(job.id, limit=1000).data
            assert job.status == "succeeded", (
                [e.message for e in events][:40],
                (tmp_path / "worker.log").read_text()[-4000:],
            )
            judged = chat_requests_answered(serving_url) - before
    finally:
        configure_celery()
        app.state.engine.dispose()

    steps = [e.data for e in events if e.data and "reward_mean" in e.data]  # type: ignore[operator]
    print(f"judged by the serving process: {judged:g} chat requests; steps: ", end="")
    print([(s["reward_mean"], s["sub_rewards"], s["grader_error_flags"]) for s in steps])  # type: ignore[index]
    assert len(steps) == PROMPTS // BATCH, json.dumps(steps)[:2000]
    for step in steps:
        assert set(step["sub_rewards"]) == {"keyword", "judge"}, step  # type: ignore[index]
        assert "model_grader_server_error" not in step["grader_error_flags"], step  # type: ignore[index]
    assert judged >= PROMPTS * SAMPLES, judged

"""A job's grading on a worker (worker.grading.job_grading): the server's sandbox limits for every job; a
judge only for a grader with model graders, asking the serving process the settings name, its
connections closed with the run; and a job with model graders on a worker that knows no serving process
refused before it starts, never trained on rewards of 0; the embedding model's setting gives every job
the cosine metric's embedder."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from contract.method import ReinforcementMethod, SupervisedMethod
from contract.serving import JudgeModels, ServedModel
from store.serving_endpoint import ServingEndpoint
from store.settings import Settings
from trainer.graders.embedding import Embedder
from trainer.graders.serving_judge import ServingJudge
from trainer.samples import KEYWORD_GRADER, MODELS_DIR
from worker.grading import NoJudgeError, job_grading, sandbox_limits

SETTINGS = Settings(_env_file=None, python_grader_wall_seconds=7)  # type: ignore[call-arg]
NO_SERVING = ServingEndpoint(_env_file=None)  # type: ignore[call-arg]
SERVING = ServingEndpoint(
    _env_file=None,  # type: ignore[call-arg]
    inference_server_url="http://serving:8001",
    inference_server_token=SecretStr("token"),
)
JUDGES = JudgeModels(team="t", models={"tiny-llama": ServedModel(id="tiny-llama", source="tiny-llama")})


def _method(judges: JudgeModels | None) -> ReinforcementMethod:
    return ReinforcementMethod.model_validate({"grader": KEYWORD_GRADER, "judges": judges})


@pytest.mark.parametrize("method", [SupervisedMethod(), _method(None)])
def test_a_job_without_model_graders_gets_the_limits_and_no_judge(method: object) -> None:
    with job_grading(SETTINGS, SERVING, method) as grading:  # type: ignore[arg-type]
        assert grading.limits == sandbox_limits(SETTINGS) and grading.limits.wall_seconds == 7
        assert grading.judge is None


def test_model_graders_are_judged_by_the_serving_process_until_the_run_ends() -> None:
    with job_grading(SETTINGS, SERVING, _method(JUDGES)) as grading:
        judge = grading.judge
        assert isinstance(judge, ServingJudge) and not judge._client.is_closed
        assert str(judge._client.base_url) == "http://serving:8001"
        assert judge._client.headers["Authorization"] == "Bearer token"
    assert judge._client.is_closed


def test_model_graders_on_a_worker_without_a_serving_process_are_refused_before_the_run() -> None:
    with (
        pytest.raises(NoJudgeError, match="ZENFLOW_API_INFERENCE_SERVER_URL"),
        job_grading(SETTINGS, NO_SERVING, _method(JUDGES)),
    ):
        pytest.fail("the run started")


def test_the_embedding_model_setting_gives_every_job_its_cosine_embedder() -> None:
    folder = str(MODELS_DIR / "docs-llama")
    settings = SETTINGS.model_copy(update={"grader_embedding_model": folder})
    for method in (_method(None), _method(JUDGES)):
        with job_grading(settings, SERVING, method) as grading:
            assert isinstance(grading.embed, Embedder) and grading.embed.folder == folder
    with job_grading(SETTINGS, SERVING, _method(None)) as grading:
        assert grading.embed is None

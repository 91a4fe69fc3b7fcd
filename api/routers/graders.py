"""``/v1/fine_tuning/alpha/graders``: a grader checked (``validate``) or run on one sample (``run``), as the
``openai`` SDK's ``client.fine_tuning.alpha.graders`` calls them (``trainer.graders``).

Team-scoped: a model grader may name only a model the team may use (``api.model_names.team_model``: 404
naming the grader's ``model`` otherwise) and is judged through the app's engine client. Grading runs in a
worker thread, never on the event loop, and is waited for at most :data:`RUN_TIMEOUT_S` (504 after). A
Python grader runs under the server's sandbox limits (``ZENFLOW_PYTHON_GRADER_*``, worker.grading).
"""

from __future__ import annotations

import json
from typing import Any

import anyio
from fastapi import APIRouter, Request

from api.core.deps import SettingsDep, TeamDep, run_db
from api.core.errors import APIError, error_responses
from api.graders_judge import EngineJudge
from api.jobs.grader_check import invalid_grader
from api.model_names import served, team_model
from api.schemas import (
    GraderRunMetadata,
    GraderRunObject,
    GraderRunRequest,
    GraderValidateObject,
    GraderValidateRequest,
)
from contract.graders import AnyGrader
from serving.client import EngineClient, ServedModel
from store.settings import Settings
from trainer.graders.grade import grade
from trainer.graders.result import GradeResult, Sample
from trainer.graders.validate import grader_errors, model_graders
from worker.grading import embeddings, sandbox_limits

router = APIRouter(
    prefix="/v1/fine_tuning/alpha/graders", tags=["graders"], responses=error_responses(400, 401, 404, 413)
)

#: The longest a run's grading is waited for (a model grader's generations included).
RUN_TIMEOUT_S = 120.0
#: The item's JSON, at most.
MAX_ITEM_BYTES = 512 * 1024


async def _judge_models(
    request: Request, grader: AnyGrader, team_id: str, settings: Settings
) -> dict[str, ServedModel]:
    """The models the grader's model graders name, resolved for the team (404 naming the param)."""
    models: dict[str, ServedModel] = {}
    for param, model in model_graders(grader):
        if model not in models:
            ref = await run_db(request, team_model, team_id, model, settings, param=param)
            models[model] = served(ref)
    return models


async def _check(grader: AnyGrader, models: dict[str, ServedModel], settings: Settings) -> None:
    """A 400 naming the first problem of the grader (a Python grader's source is imported in the sandbox,
    under the server's limits, in a worker thread: never on the event loop)."""
    limits = sandbox_limits(settings)

    def problems_of() -> list[tuple[str, str]]:
        return grader_errors(
            grader,
            judge_models=models.__contains__,
            embeddings=bool(settings.grader_embedding_model),
            limits=limits,
        )

    problems = await anyio.to_thread.run_sync(problems_of)
    if problems:
        raise invalid_grader(problems)


@router.post("/validate", response_model=GraderValidateObject)
async def validate_grader(
    body: GraderValidateRequest, request: Request, team: TeamDep, settings: SettingsDep
) -> GraderValidateObject:
    """The grader as given when it is valid; a 400 naming the first bad param otherwise."""
    models = await _judge_models(request, body.grader, team.team_id, settings)
    await _check(body.grader, models, settings)
    return GraderValidateObject(grader=body.grader.model_dump(mode="json", exclude_unset=True))


def run_object(result: GradeResult) -> GraderRunObject:
    """A grade result in OpenAI's ``GraderRunResponse`` shape."""
    metadata = GraderRunMetadata(
        name=result.name,
        type=result.type,
        errors=result.errors.as_dict(),
        execution_time=result.execution_time,
        scores=result.scores,
        token_usage=result.token_usage,
        sampled_model_name=result.sampled_model_name,
    )
    return GraderRunObject(
        reward=result.reward,
        metadata=metadata,
        sub_rewards=dict(result.sub_rewards),
        model_grader_token_usage_per_model=dict(result.usage_per_model),
    )


def _item_size(item: dict[str, Any]) -> None:
    size = len(json.dumps(item, ensure_ascii=False).encode())
    if size > MAX_ITEM_BYTES:
        raise APIError(400, f"item is {size} bytes of JSON, over the limit of {MAX_ITEM_BYTES}", param="item")


@router.post("/run", response_model=GraderRunObject, responses=error_responses(504))
async def run_grader(
    body: GraderRunRequest, request: Request, team: TeamDep, settings: SettingsDep
) -> GraderRunObject:
    """The grader's reward for ``model_sample`` on ``item``, with OpenAI's error flags: a grader that fails
    on this sample is a 200 with its flag set, never an error of the request."""
    _item_size(body.item)
    models = await _judge_models(request, body.grader, team.team_id, settings)
    await _check(body.grader, models, settings)
    engine: EngineClient = request.app.state.inference
    judge = EngineJudge(engine, team.team_id, models)
    sample = Sample.of_text(body.model_sample)
    limits, embed = sandbox_limits(settings), embeddings(settings)

    def run() -> GradeResult:
        return grade(body.grader, sample, body.item, judge=judge, limits=limits, embed=embed)

    with anyio.move_on_after(RUN_TIMEOUT_S) as scope:
        result = await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
    if scope.cancelled_caught:
        raise APIError(504, f"the grader did not finish within {RUN_TIMEOUT_S:g} s", code="timeout")
    return run_object(result)

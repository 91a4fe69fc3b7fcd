"""``/v1/chat/completions`` and ``/v1/completions``: generation on the team's models. The route resolves
the model for the team and hands the request to the app's engine client (``serving.client``): the engine
in this process, or the serving process's."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from api.core.deps import SettingsDep, TeamDep, run_db
from api.core.errors import error_responses
from api.model_names import served, team_model
from serving.client import Call, EngineClient
from serving.schemas import (
    ChatCompletionObject,
    ChatCompletionRequest,
    CompletionRequest,
    TextCompletionObject,
)
from store.settings import Settings

router = APIRouter(prefix="/v1", tags=["inference"], responses=error_responses(400, 401, 404, 429, 503, 504))

_STREAM: dict[str, Any] = {"text/event-stream": {}}


def _engine(request: Request) -> EngineClient:
    engine: EngineClient = request.app.state.inference
    return engine


async def _generate(
    request: Request, body: ChatCompletionRequest | CompletionRequest, team_id: str, settings: Settings
) -> Any:
    ref = await run_db(request, team_model, team_id, body.model, settings)
    return await _engine(request).generate(Call(body, served(ref), team_id, request.is_disconnected))


@router.post(
    "/chat/completions",
    response_model=ChatCompletionObject,
    responses={
        200: {
            "content": _STREAM,
            "description": "The completion, or with stream=true "
            "chat.completion.chunk events ending with data: [DONE]",
        },
        **error_responses(502),
    },
)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, team: TeamDep, settings: SettingsDep
) -> Any:
    """A reply to ``messages`` from a base model or one of the team's fine-tuned models, through the
    model's chat template."""
    return await _generate(request, body, team.team_id, settings)


@router.post(
    "/completions",
    response_model=TextCompletionObject,
    responses={
        200: {
            "content": _STREAM,
            "description": "The completion, or with stream=true "
            "text_completion events ending with data: [DONE]",
        },
        **error_responses(502),
    },
)
async def create_completion(
    body: CompletionRequest, request: Request, team: TeamDep, settings: SettingsDep
) -> Any:
    """A continuation of ``prompt`` as it is (no chat template), for prompt-style models."""
    return await _generate(request, body, team.team_id, settings)

"""``/v1/chat/completions`` and ``/v1/completions``: generation on the team's models (api.inference)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from api.core.deps import SettingsDep, TeamDep, run_db
from api.core.errors import error_responses
from api.inference.schemas import (
    ChatCompletionObject,
    ChatCompletionRequest,
    CompletionRequest,
    TextCompletionObject,
)
from api.inference.service import InferenceService
from api.model_names import team_model

router = APIRouter(prefix="/v1", tags=["inference"], responses=error_responses(400, 401, 404, 429, 503, 504))

_STREAM: dict[str, Any] = {"text/event-stream": {}}


def _service(request: Request) -> InferenceService:
    service: InferenceService = request.app.state.inference
    return service


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
    ref = await run_db(request, team_model, team.team_id, body.model, settings)
    return await _service(request).chat(request, ref, body, team.team_id)


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
    ref = await run_db(request, team_model, team.team_id, body.model, settings)
    return await _service(request).completion(request, ref, body, team.team_id)

"""The model graders' judge in the API: a chat completion through the app's engine client
(``serving.client.EngineClient``), called from the grading thread (``trainer.graders.model_graders.Judge``
is synchronous; the engine is async, on the event loop this thread came from)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import anyio.from_thread
from starlette.responses import Response

from serving.client import Call, EngineClient, ServedModel, never_disconnected
from serving.errors import ServingError
from serving.schemas import ChatCompletionRequest
from trainer.graders.model_graders import JudgeError, JudgeReply, reply_of


class EngineJudge:
    """Judges with the models the route resolved for the team (``models``: name -> served model)."""

    def __init__(self, engine: EngineClient, team_id: str, models: Mapping[str, ServedModel]) -> None:
        self._engine = engine
        self._team_id = team_id
        self._models = dict(models)

    def chat(self, model: str, messages: list[dict[str, Any]], sampling: dict[str, Any]) -> JudgeReply:
        served = self._models.get(model)
        if served is None:
            raise JudgeError(f"the model {model!r} was not resolved for this team")
        try:
            body = ChatCompletionRequest.model_validate({"model": model, "messages": messages, **sampling})
            reply = anyio.from_thread.run(
                self._engine.generate, Call(body, served, self._team_id, never_disconnected)
            )
        except ServingError as err:
            raise JudgeError(f"{err.status_code}: {err.message}") from None
        except ValueError as err:  # the prompt does not make a chat request (e.g. over a serving bound)
            raise JudgeError(str(err)[:500]) from None
        return reply_of(_completion(reply), model)


def _completion(reply: dict[str, Any] | Response) -> dict[str, Any]:
    if isinstance(reply, dict):
        return reply
    try:
        parsed = json.loads(bytes(reply.body))
    except (AttributeError, ValueError):
        raise JudgeError("the engine answered with a stream, not a completion") from None
    if not isinstance(parsed, dict):
        raise JudgeError("the engine's answer is not a completion object")
    return parsed

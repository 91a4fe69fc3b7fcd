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
from trainer.graders.model_graders import JudgeError, JudgeReply


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
        return _reply(_completion(reply), model)


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


def _reply(completion: dict[str, Any], model: str) -> JudgeReply:
    try:
        message = completion["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise JudgeError("the engine's answer has no message") from None
    usage = completion.get("usage") or {}
    counts = {k: int(usage[k]) for k in ("prompt_tokens", "completion_tokens", "total_tokens") if k in usage}
    return JudgeReply(
        text=str(message.get("content") or ""),
        model=str(completion.get("model") or model),
        token_usage=counts,
        refusal=message.get("refusal"),
    )

"""The one protocol the HTTP layer talks to for generation (vLLM's ``EngineClient`` is the model): the
API's chat and completion routes call an :class:`EngineClient` and never see decode threads, models or
vLLM. Two implement it: ``serving.local.LocalEngine`` (the engine in this process: the built-in backend,
and vLLM forwarding for the models vLLM serves) and ``serving.remote.RemoteEngine`` (the same engine in
the serving process, over HTTP). Either raises ``serving.errors.ServingError`` for a request it refuses
or cannot finish, before the answer starts; once a stream has started, errors come inside it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.responses import Response

from contract.serving import ServedModel
from serving.schemas import ChatCompletionRequest, CompletionRequest

__all__ = ["Call", "Disconnected", "EngineClient", "Reply", "ServedModel", "never_disconnected"]

#: Whether the client that asked has gone (the engine then stops the generation at its next token).
Disconnected = Callable[[], Awaitable[bool]]

#: An answer: the completion object, or a response of the engine's own (a server-sent event stream,
#: or vLLM's answer passed through).
Reply = dict[str, Any] | Response


@dataclass(frozen=True)
class Call:
    """One generation request: the validated body, the model it names, the team asking (admission and
    fair shares are by team), and how to tell that the client has gone."""

    body: ChatCompletionRequest | CompletionRequest
    model: ServedModel
    team: str
    disconnected: Disconnected

    @property
    def endpoint(self) -> str:
        return "chat" if isinstance(self.body, ChatCompletionRequest) else "completions"


class EngineClient(Protocol):
    async def generate(self, call: Call) -> Reply:
        """The answer to ``call`` (whole, or a stream that has started); ``ServingError`` before that."""
        ...

    async def aclose(self) -> None: ...


async def never_disconnected() -> bool:
    return False

"""The engine in this process: a request checked against the server's per-request caps, then answered
by vLLM when it is configured and serves that model (``serving.vllm``), else by the built-in backend
(``serving.builtin.engine``). The serving process runs one (``serving.server``); so does the API when no
serving process is configured (the embedded default).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from serving.builtin.engine import BuiltinBackend
from serving.client import Call, Reply
from serving.errors import ServingError
from serving.schemas import ChatCompletionRequest, CompletionRequest
from serving.vllm import VLLMForwarder

if TYPE_CHECKING:
    from serving.config import ServingSettings


class LocalEngine:
    """An :class:`~serving.client.EngineClient` that runs the generation here."""

    def __init__(self, settings: ServingSettings) -> None:
        self.settings = settings
        self.builtin = BuiltinBackend(settings)
        self.vllm = (
            VLLMForwarder(
                settings.inference_vllm_url,
                timeout_seconds=settings.inference_timeout_seconds,
                max_requests=settings.inference_vllm_max_requests,
            )
            if settings.inference_backend == "vllm"
            else None
        )

    async def aclose(self) -> None:
        self.builtin.close()
        if self.vllm is not None:
            await self.vllm.aclose()

    async def generate(self, call: Call) -> Reply:
        body = call.body
        limit_param = self._check_counts(body)
        prompts = 1 if isinstance(body, ChatCompletionRequest) else len(body.prompts)
        default_limit = self._completion_budget(prompts * body.n, body.token_limit, limit_param)
        if self.vllm is not None:
            upstream = await self.vllm.route(call.model)
            if upstream is not None:
                path = "/v1/chat/completions" if call.endpoint == "chat" else "/v1/completions"
                return await self.vllm.forward(
                    path,
                    body.model_dump(exclude_unset=True),
                    upstream,
                    stream=body.stream,
                    endpoint=call.endpoint,
                )
        return await self.builtin.generate(call, limit_param, default_limit)

    def _check_counts(self, body: ChatCompletionRequest | CompletionRequest) -> str:
        """The request's prompt count and token limit against the server's caps (400 naming the field);
        the name of the limit it gave."""
        if isinstance(body, CompletionRequest):
            count, cap = len(body.prompts), self.settings.inference_max_prompts
            if count > cap:  # counted before anything else looks at them
                raise ServingError(
                    400,
                    f"prompt: {count} prompts, over this server's {cap} per request",
                    param="prompt",
                    code="invalid_value",
                )
        limit_param = (
            "max_completion_tokens"
            if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None
            else "max_tokens"
        )
        limit, server_max = body.token_limit, self.settings.inference_max_tokens
        if limit is not None and limit > server_max:
            raise ServingError(
                400,
                f"{limit_param}: at most {server_max} on this server",
                param=limit_param,
                code="invalid_value",
            )
        return limit_param

    def _completion_budget(self, rows: int, limit: int | None, limit_param: str) -> int:
        """The default ``max_tokens`` of a request of ``rows`` choices (prompts x n) within
        ``inference_max_request_tokens``; 400 when the request asks for more."""
        budget = self.settings.inference_max_request_tokens
        server_max = self.settings.inference_max_tokens
        if limit is not None and rows * limit > budget:
            raise ServingError(
                400,
                f"{limit_param}: {rows} choices (prompts x n) x {limit} tokens = {rows * limit}, over this "
                f"server's {budget} completion tokens per request",
                param=limit_param,
                code="invalid_value",
            )
        default = min(server_max, budget // rows)
        if default < 1:
            raise ServingError(
                400,
                f"n: {rows} choices (prompts x n), over this server's {budget} completion tokens per request",
                param="n",
                code="invalid_value",
            )
        return default

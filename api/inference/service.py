"""What the chat and completion endpoints run: a request for a resolved model, answered by vLLM when it
is configured and serves that model, else by the built-in backend (a generation thread of
``api.inference.generation_pool``), as one JSON object or a server-sent event stream.

The handler waits for the generation's first event before it answers, so the model failing to load,
or a prompt too long for its context, is still an HTTP error status; after that, errors come inside
the stream as ``data: {"error": ...}`` (what the openai SDK raises from). While the handler waits it
watches for the client going away; once streaming, Starlette cancels the stream when the client
disconnects. Either way the generation is cancelled and stops at its next token.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import Request

from api.core.errors import APIError
from api.inference import builtin, prometheus
from api.inference.generation_pool import (
    Cancelled,
    Completed,
    Delta,
    Event,
    Failed,
    Finished,
    GenerationPool,
    QueueFull,
    Started,
    Ticket,
    TimedOut,
)
from api.inference.model_cache import ModelCache
from api.inference.responses import DONE, ChatShape, EventStream, Shape, TextShape, sse
from api.inference.schemas import ChatCompletionRequest, CompletionRequest
from api.inference.team_shares import Refusal
from api.inference.vllm import VLLMForwarder
from api.model_names import spec_model_name

if TYPE_CHECKING:
    from api.core.config import ApiSettings
    from api.model_names import ModelRef

log = logging.getLogger(__name__)

#: How often a waiting handler looks for its client having gone.
DISCONNECT_POLL_SECONDS = 0.25
BUILTIN = "builtin"


def queue_full(retry_after: float, refusal: Refusal | None = None) -> APIError:
    seconds = max(1, math.ceil(retry_after))
    if refusal is not None and refusal.team_full:
        message = (
            f"Your team has {refusal.team_held} inference requests in progress, its share of this "
            f"server's slots while {refusal.teams} team{'s' if refusal.teams != 1 else ''} use"
            f"{'' if refusal.teams != 1 else 's'} it; retry after {seconds} s"
        )
    else:
        message = f"Too many inference requests in progress; retry after {seconds} s"
    return APIError(
        429,
        message,
        code="rate_limit_exceeded",
        headers={"Retry-After": str(seconds)},
    )


def timed_out(timeout: float) -> APIError:
    return APIError(504, f"The request did not finish within {timeout:g} s", code="timeout")


def as_api_error(exc: BaseException, timeout: float) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, TimedOut):
        return timed_out(timeout)
    if isinstance(exc, Cancelled):  # nobody reads this: the client is gone (nginx's 499)
        return APIError(499, "The client closed the request", code="client_closed_request")
    log.error("inference failed", exc_info=exc)
    return APIError(500, "Internal server error during generation", code="internal_error")


class InferenceService:
    """The app's inference: settings, the built-in model cache and generation pool, and the vLLM forwarder."""

    def __init__(self, settings: ApiSettings) -> None:
        self.settings = settings
        self.cache = ModelCache(
            max_models=settings.inference_max_models,
            memory_bytes=settings.inference_memory_bytes,
            device=settings.inference_device,
            dtype=settings.inference_dtype,
        )
        self.pool = GenerationPool(
            threads=settings.inference_threads,
            queue_size=settings.inference_queue_size,
            timeout_seconds=settings.inference_timeout_seconds,
            batch_rows=settings.inference_batch_rows,
            slice_seconds=settings.inference_slice_seconds,
        )
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
        self.pool.shutdown()
        if self.vllm is not None:
            await self.vllm.aclose()
        self.cache.clear()

    async def chat(self, request: Request, ref: ModelRef, body: ChatCompletionRequest, team_id: str) -> Any:
        prompt = builtin.Prompt("messages", messages=tuple(m.template_dict() for m in body.messages))
        limit_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        return await self._run(
            request, ref, body, ChatShape(body.model), (prompt,), limit_param, "/v1/chat/completions", team_id
        )

    async def completion(self, request: Request, ref: ModelRef, body: CompletionRequest, team_id: str) -> Any:
        count = len(body.prompt) if isinstance(body.prompt, list) else 1
        cap = self.settings.inference_max_prompts
        if count > cap:  # counted before anything else looks at them
            raise APIError(
                400,
                f"prompt: {count} prompts, over this server's {cap} per request",
                param="prompt",
                code="invalid_value",
            )
        many = isinstance(body.prompt, list)
        prompts = tuple(
            builtin.Prompt(f"prompt[{i}]" if many else "prompt", text=p, echo=body.echo)
            for i, p in enumerate(body.prompts)
        )
        return await self._run(
            request, ref, body, TextShape(body.model), prompts, "max_tokens", "/v1/completions", team_id
        )

    def _completion_budget(self, rows: int, limit: int | None, limit_param: str) -> int:
        """The default ``max_tokens`` of a request of ``rows`` choices (prompts x n) within
        ``inference_max_request_tokens``; 400 when the request asks for more."""
        budget = self.settings.inference_max_request_tokens
        server_max = self.settings.inference_max_tokens
        if limit is not None and rows * limit > budget:
            raise APIError(
                400,
                f"{limit_param}: {rows} choices (prompts x n) x {limit} tokens = {rows * limit}, over this "
                f"server's {budget} completion tokens per request",
                param=limit_param,
                code="invalid_value",
            )
        default = min(server_max, budget // rows)
        if default < 1:
            raise APIError(
                400,
                f"n: {rows} choices (prompts x n), over this server's {budget} completion tokens per request",
                param="n",
                code="invalid_value",
            )
        return default

    async def _run(
        self,
        request: Request,
        ref: ModelRef,
        body: ChatCompletionRequest | CompletionRequest,
        shape: Shape,
        prompts: tuple[builtin.Prompt, ...],
        limit_param: str,
        path: str,
        team_id: str,
    ) -> Any:
        limit = body.token_limit
        server_max = self.settings.inference_max_tokens
        if limit is not None and limit > server_max:
            raise APIError(
                400,
                f"{limit_param}: at most {server_max} on this server",
                param=limit_param,
                code="invalid_value",
            )
        default_limit = self._completion_budget(len(prompts) * body.n, limit, limit_param)
        if self.vllm is not None:
            upstream = await self.vllm.route(ref)
            if upstream is not None:
                return await self.vllm.forward(
                    path,
                    body.model_dump(exclude_unset=True),
                    upstream,
                    stream=body.stream,
                    endpoint=shape.endpoint,
                )
        req = builtin.BuiltinRequest(
            spec_model_name(ref),
            prompts,
            body.sampling(limit),
            limit,
            limit_param,
            default_limit,
            shape.endpoint,
            team=team_id,
            max_prompt_tokens=self.settings.inference_max_prompt_tokens,
            max_request_prompt_tokens=self.settings.inference_max_request_prompt_tokens,
        )
        try:
            ticket = self.pool.submit(team_id, partial(builtin.prepare, self.cache, req))
        except QueueFull as full:
            prometheus.request_done(shape.endpoint, BUILTIN, "rejected")
            raise queue_full(self.settings.inference_retry_after_seconds, full.refusal) from None
        run = _Run(ticket, shape, self.settings.inference_timeout_seconds)
        watcher = asyncio.create_task(_watch_disconnect(request, ticket))
        try:
            if not body.stream:
                return await run.result()
            await run.started()
        except BaseException:
            ticket.cancel()
            raise
        finally:
            watcher.cancel()
        return EventStream(run.stream(body.n * len(prompts), body.include_usage), on_close=run.close)


async def _watch_disconnect(request: Request, ticket: Ticket) -> None:
    """Cancel ``ticket`` when the client goes away while the handler still waits."""
    while not ticket.cancelled:
        if await request.is_disconnected():
            ticket.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)


class _Run:
    """One admitted built-in request, read from its ticket's events; records its metrics once."""

    def __init__(self, ticket: Ticket, shape: Shape, timeout: float) -> None:
        self.ticket, self.shape, self.timeout = ticket, shape, timeout
        self.first_token_seen = False
        self.recorded = False

    async def _next(self) -> Event:
        event = await self.ticket.next_event()
        if isinstance(event, Delta) and not self.first_token_seen:
            self.first_token_seen = True
            prometheus.get().first_token.labels(self.shape.endpoint).observe(
                time.monotonic() - self.ticket.admitted_at
            )
        return event

    def _done(self, outcome: str) -> None:
        if not self.recorded:
            self.recorded = True
            prometheus.request_done(
                self.shape.endpoint, BUILTIN, outcome, time.monotonic() - self.ticket.admitted_at
            )

    def _fail(self, exc: BaseException) -> APIError:
        err = as_api_error(exc, self.timeout)
        outcome = (
            "timeout"
            if isinstance(exc, TimedOut)
            else "cancelled"
            if isinstance(exc, Cancelled)
            else "invalid"
            if err.status_code < 500
            else "error"
        )
        self._done(outcome)
        return err

    async def _until(self, last: type[Started] | type[Completed]) -> Event:
        """Events up to the first ``last`` (returned); a failure is raised as the HTTP error."""
        while True:
            try:
                event = await self._next()
            except TimedOut as e:
                raise self._fail(e) from None
            if isinstance(event, Failed):
                raise self._fail(event.error) from None
            if isinstance(event, last):
                return event

    async def result(self) -> dict[str, Any]:
        """Wait for the whole completion."""
        done = await self._until(Completed)
        assert isinstance(done, Completed)
        self._done("ok")
        return self.shape.final(done.texts, done.finish_reasons, done.prompt_tokens, done.completion_tokens)

    async def started(self) -> None:
        """Wait until generation begins (``Started`` is the first event of a generation)."""
        await self._until(Started)

    async def close(self) -> None:
        """However the stream ended (done, failed, the client gone before or during it)."""
        self.ticket.cancel()
        self._done("cancelled")  # a no-op when the stream recorded how it ended

    async def stream(self, n: int, include_usage: bool) -> AsyncIterator[str]:
        try:
            for chunk in self.shape.opening(n):
                yield sse(chunk)
            while True:
                event = await self._next()
                if isinstance(event, Delta):
                    yield sse(self.shape.delta(event.index, event.text))
                elif isinstance(event, Finished):
                    yield sse(self.shape.finish(event.index, event.reason))
                elif isinstance(event, Completed):
                    self._done("ok")
                    if include_usage:
                        yield sse(self.shape.usage_chunk(event.prompt_tokens, event.completion_tokens))
                    yield DONE
                    return
                elif isinstance(event, Failed):
                    yield sse(self._fail(event.error).body())
                    return
        except TimedOut as e:
            yield sse(self._fail(e).body())
        finally:
            await self.close()

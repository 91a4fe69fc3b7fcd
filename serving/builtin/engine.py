"""The built-in backend as the engine runs it: a request's prompts and caps turned into a
:class:`~serving.builtin.prepare.BuiltinRequest`, admitted to the generation pool by team (429 with
``Retry-After`` beyond its share), and its ticket's events read back as the whole completion or as a
server-sent event stream.

The caller waits for the generation's first event before it answers, so the model failing to load, or a
prompt too long for its context, is still an HTTP error status; after that, errors come inside the stream
as ``data: {"error": ...}`` (what the openai SDK raises from). While it waits it watches for the client
going away; once streaming, closing the stream (Starlette does when the client disconnects) cancels the
generation, which stops at its next token.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import TYPE_CHECKING, Any

from serving import prometheus
from serving.builtin import prepare
from serving.builtin.generation_pool import (
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
from serving.builtin.model_cache import ModelCache
from serving.builtin.team_shares import Refusal
from serving.client import Call, Disconnected, Reply
from serving.errors import ServingError
from serving.responses import DONE, ChatShape, EventStream, Shape, TextShape, sse
from serving.schemas import ChatCompletionRequest

if TYPE_CHECKING:
    from serving.config import ServingSettings

log = logging.getLogger(__name__)

#: How often a waiting request looks for its client having gone.
DISCONNECT_POLL_SECONDS = 0.25
BACKEND = "builtin"


def queue_full(retry_after: float, refusal: Refusal | None = None) -> ServingError:
    seconds = max(1, math.ceil(retry_after))
    if refusal is not None and refusal.team_full:
        message = (
            f"Your team has {refusal.team_held} inference requests in progress, its share of this "
            f"server's slots while {refusal.teams} team{'s' if refusal.teams != 1 else ''} use"
            f"{'' if refusal.teams != 1 else 's'} it; retry after {seconds} s"
        )
    else:
        message = f"Too many inference requests in progress; retry after {seconds} s"
    return ServingError(
        429,
        message,
        code="rate_limit_exceeded",
        headers={"Retry-After": str(seconds)},
    )


def timed_out(timeout: float) -> ServingError:
    return ServingError(504, f"The request did not finish within {timeout:g} s", code="timeout")


def as_serving_error(exc: BaseException, timeout: float) -> ServingError:
    if isinstance(exc, ServingError):
        return exc
    if isinstance(exc, TimedOut):
        return timed_out(timeout)
    if isinstance(exc, Cancelled):  # nobody reads this: the client is gone (nginx's 499)
        return ServingError(499, "The client closed the request", code="client_closed_request")
    log.error("inference failed", exc_info=exc)
    return ServingError(500, "Internal server error during generation", code="internal_error")


class BuiltinBackend:
    """The built-in backend: the model cache and the generation pool, sized by the settings."""

    def __init__(self, settings: ServingSettings) -> None:
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

    def close(self) -> None:
        self.pool.shutdown()
        self.cache.clear()

    async def generate(self, call: Call, limit_param: str, default_limit: int) -> Reply:
        """``call`` admitted and run; the completion, or its stream once generation has started."""
        body, settings = call.body, self.settings
        shape: Shape = (
            ChatShape(body.model) if isinstance(body, ChatCompletionRequest) else TextShape(body.model)
        )
        req = prepare.BuiltinRequest(
            call.model.source,
            prompts_of(call),
            body.sampling(body.token_limit),
            body.token_limit,
            limit_param,
            default_limit,
            shape.endpoint,
            team=call.team,
            max_prompt_tokens=settings.inference_max_prompt_tokens,
            max_request_prompt_tokens=settings.inference_max_request_prompt_tokens,
        )
        try:
            ticket = self.pool.submit(call.team, partial(prepare.prepare, self.cache, req))
        except QueueFull as full:
            prometheus.request_done(shape.endpoint, BACKEND, "rejected")
            raise queue_full(settings.inference_retry_after_seconds, full.refusal) from None
        run = _Run(ticket, shape, settings.inference_timeout_seconds)
        watcher = asyncio.create_task(_watch_disconnect(call.disconnected, ticket))
        try:
            if not body.stream:
                return await run.result()
            await run.started()
        except BaseException:
            ticket.cancel()
            raise
        finally:
            watcher.cancel()
        return EventStream(run.stream(body.n * len(req.prompts), body.include_usage), on_close=run.close)


def prompts_of(call: Call) -> tuple[prepare.Prompt, ...]:
    """The request's prompts: a chat's conversation, or each prompt of a completion (``prompt[i]`` in
    errors when it gave a list)."""
    body = call.body
    if isinstance(body, ChatCompletionRequest):
        return (prepare.Prompt("messages", messages=tuple(m.template_dict() for m in body.messages)),)
    many = isinstance(body.prompt, list)
    return tuple(
        prepare.Prompt(f"prompt[{i}]" if many else "prompt", text=p, echo=body.echo)
        for i, p in enumerate(body.prompts)
    )


async def _watch_disconnect(disconnected: Disconnected, ticket: Ticket) -> None:
    """Cancel ``ticket`` when the client goes away while the request still waits."""
    while not ticket.cancelled:
        if await disconnected():
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
                self.shape.endpoint, BACKEND, outcome, time.monotonic() - self.ticket.admitted_at
            )

    def _fail(self, exc: BaseException) -> ServingError:
        err = as_serving_error(exc, self.timeout)
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

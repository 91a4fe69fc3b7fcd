"""The objects the endpoints answer with, in OpenAI's shapes: a whole completion, or the chunks of a
stream (``chat.completion.chunk`` / ``text_completion``) as server-sent events ending ``data: [DONE]``."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from store.ids import new_id

DONE = "data: [DONE]\n\n"
#: No caching, and no buffering by a proxy in front (nginx honours X-Accel-Buffering).
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(StreamingResponse):
    """A server-sent event stream whose ``on_close`` runs however the response ends: finished, or the
    client gone before the first chunk (Starlette then never starts the iterator, so a ``finally`` in
    it would not run) or during the stream."""

    def __init__(
        self, content: AsyncIterable[str | bytes], *, on_close: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers=STREAM_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Shape:
    """One response's id, timestamp and model, and its objects; subclasses give the endpoint's shape."""

    endpoint = ""
    id_prefix = ""

    def __init__(self, model: str) -> None:
        self.id = new_id(self.id_prefix)
        self.created = int(time.time())
        self.model = model

    def _obj(self, object_: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            **extra,
        }

    def opening(self, n: int) -> list[dict[str, Any]]:
        """Chunks before the first token."""
        return []

    def final(
        self, texts: dict[int, str], reasons: dict[int, str], prompt_tokens: int, completion_tokens: int
    ) -> dict[str, Any]:
        raise NotImplementedError

    def delta(self, index: int, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def finish(self, index: int, reason: str) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        raise NotImplementedError


class ChatShape(Shape):
    endpoint = "chat"
    id_prefix = "chatcmpl"

    def final(
        self, texts: dict[int, str], reasons: dict[int, str], prompt_tokens: int, completion_tokens: int
    ) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": texts[i], "refusal": None},
                "finish_reason": reasons[i],
                "logprobs": None,
            }
            for i in sorted(texts)
        ]
        return self._obj("chat.completion", choices, usage=usage(prompt_tokens, completion_tokens))

    def opening(self, n: int) -> list[dict[str, Any]]:
        return [
            self._chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                        "logprobs": None,
                    }
                ]
            )
            for i in range(n)
        ]

    def delta(self, index: int, text: str) -> dict[str, Any]:
        return self._chunk(
            [{"index": index, "delta": {"content": text}, "finish_reason": None, "logprobs": None}]
        )

    def finish(self, index: int, reason: str) -> dict[str, Any]:
        return self._chunk([{"index": index, "delta": {}, "finish_reason": reason, "logprobs": None}])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return self._chunk([], usage=usage(prompt_tokens, completion_tokens))

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return self._obj("chat.completion.chunk", choices, **extra)


class TextShape(Shape):
    endpoint = "completions"
    id_prefix = "cmpl"

    def final(
        self, texts: dict[int, str], reasons: dict[int, str], prompt_tokens: int, completion_tokens: int
    ) -> dict[str, Any]:
        choices = [
            {"index": i, "text": texts[i], "finish_reason": reasons[i], "logprobs": None}
            for i in sorted(texts)
        ]
        return self._obj("text_completion", choices, usage=usage(prompt_tokens, completion_tokens))

    def delta(self, index: int, text: str) -> dict[str, Any]:
        return self._obj(
            "text_completion", [{"index": index, "text": text, "finish_reason": None, "logprobs": None}]
        )

    def finish(self, index: int, reason: str) -> dict[str, Any]:
        return self._obj(
            "text_completion", [{"index": index, "text": "", "finish_reason": reason, "logprobs": None}]
        )

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return self._obj("text_completion", [], usage=usage(prompt_tokens, completion_tokens))

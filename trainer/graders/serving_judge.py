"""The model graders' judge in a training job: a chat completion from the serving process (``python -m
serving``), over its internal route, for the team and the models the API resolved when the job was
created (contract.serving.JudgeModels). The API's own grader routes judge through its engine client
instead (api.graders_judge); both read the answer with ``reply_of``.

Every wait is bounded: connect, and the serving process's own request timeout plus a margin. A 429 or a
503 (the team's share of the serving process taken, a restart) is retried a few times after its
``Retry-After`` (capped); what still fails is a :class:`JudgeError`, which the grader turns into reward
0 with ``model_grader_server_error`` and its details. Thread-safe: a step's graders call it at once.
"""

from __future__ import annotations

import logging
import time
from types import TracebackType
from typing import Any

import httpx

from contract.serving import INTERNAL_PATHS, JudgeModels
from trainer.graders.model_graders import JudgeError, JudgeReply, reply_of

log = logging.getLogger(__name__)

CONNECT_SECONDS = 5.0
#: Beyond the serving process's own limit (it answers 504 itself at its request timeout).
TIMEOUT_MARGIN_SECONDS = 30.0
#: Answers worth asking again after a wait: the team's admission slots full, the process not ready.
RETRY_STATUSES = frozenset({429, 503})
RETRIES = 3
#: The longest one retry waits, whatever ``Retry-After`` says.
MAX_RETRY_WAIT_SECONDS = 10.0


class ServingJudge:
    """:class:`trainer.graders.model_graders.Judge` over the serving process at ``url``."""

    def __init__(
        self,
        url: str,
        token: str,
        judges: JudgeModels,
        *,
        timeout_seconds: float,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not url or not token:
            raise ValueError("a model grader's judge needs the serving process's URL and token")
        self._judges = judges
        self._client = httpx.Client(
            base_url=url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout_seconds + TIMEOUT_MARGIN_SECONDS, connect=CONNECT_SECONDS),
            transport=transport,
        )

    def __enter__(self) -> ServingJudge:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    def chat(self, model: str, messages: list[dict[str, Any]], sampling: dict[str, Any]) -> JudgeReply:
        served = self._judges.models.get(model)
        if served is None:
            raise JudgeError(f"the model {model!r} was not resolved for this job when it was created")
        payload = {
            "team": self._judges.team,
            "model": served.model_dump(),
            "request": {"model": model, "messages": messages, **sampling},
        }
        response = self._post(payload)
        if response.status_code != 200:
            raise JudgeError(_failure(response))
        try:
            completion = response.json()
        except ValueError:
            raise JudgeError("the serving process's answer is not JSON") from None
        return reply_of(completion, model)

    def _post(self, payload: dict[str, Any]) -> httpx.Response:
        """The serving process's answer, after at most :data:`RETRIES` bounded waits on a 429 or 503."""
        for attempt in range(RETRIES + 1):
            try:
                response = self._client.post(INTERNAL_PATHS["chat"], json=payload)
            except httpx.TimeoutException:
                raise JudgeError("the serving process did not answer in time") from None
            except httpx.HTTPError as err:
                raise JudgeError(f"the serving process could not be reached ({type(err).__name__})") from None
            if response.status_code not in RETRY_STATUSES or attempt == RETRIES:
                return response
            time.sleep(_retry_after(response, attempt))
        raise AssertionError("unreachable")


def _retry_after(response: httpx.Response, attempt: int) -> float:
    """The wait its ``Retry-After`` asks (seconds), else 1, 2, 4 s; at most the cap."""
    try:
        wait = float(response.headers.get("Retry-After", ""))
    except ValueError:
        wait = float(2**attempt)
    return min(max(wait, 0.0), MAX_RETRY_WAIT_SECONDS)


def _failure(response: httpx.Response) -> str:
    """``<status>: <message>`` of an OpenAI error envelope (or the body's start)."""
    if response.status_code == 401:  # our token: a deployment fault, not the grader's
        log.error("the serving process refused this worker's inference_server_token")
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:300]
    return f"{response.status_code}: {message}"

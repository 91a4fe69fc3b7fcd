"""What a job's graders reach outside the run with, from the service's settings: the Python grader's
sandbox limits (``ZENFLOW_PYTHON_GRADER_*``: :func:`sandbox_limits`, for the API's grader routes too), the
embeddings of text_similarity's cosine (``ZENFLOW_GRADER_EMBEDDING_MODEL``: :func:`embeddings`, the API's
too) and, for a grader with model graders, the judge: the serving process (``store.serving_endpoint``)
asked for the models the API resolved for the job's team at create (:func:`job_grading`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from contract.method import MethodRequest, ReinforcementMethod
from store.serving_endpoint import ServingEndpoint
from store.settings import Settings
from trainer.graders.grading import Grading
from trainer.graders.sandbox import SandboxLimits

if TYPE_CHECKING:
    from trainer.graders.text_similarity import Embed


class NoJudgeError(RuntimeError):
    """A job whose grader has model graders on a worker that knows no serving process."""


def sandbox_limits(settings: Settings) -> SandboxLimits:
    """The limits of one Python grader call on this server."""
    return SandboxLimits(
        cpu_seconds=settings.python_grader_cpu_seconds,
        wall_seconds=settings.python_grader_wall_seconds,
        memory_bytes=settings.python_grader_memory_bytes,
        max_processes=settings.python_grader_max_processes,
        output_bytes=settings.python_grader_output_bytes,
        file_bytes=settings.python_grader_file_bytes,
        open_files=settings.python_grader_open_files,
        allow_unisolated=settings.python_grader_allow_unisolated,
    )


def embeddings(settings: Settings) -> Embed | None:
    """The embedder of text_similarity's cosine on this server (loaded at its first text), or None."""
    if not settings.grader_embedding_model:
        return None
    from trainer.graders.embedding import embedder

    return embedder(settings.grader_embedding_model)


@contextmanager
def job_grading(settings: Settings, endpoint: ServingEndpoint, method: MethodRequest) -> Iterator[Grading]:
    """The job's grading on this worker, its judge's connections closed after; NoJudgeError before the
    run starts when its model graders have no serving process to ask (never a run graded 0 throughout)."""
    limits, embed = sandbox_limits(settings), embeddings(settings)
    judges = method.judges if isinstance(method, ReinforcementMethod) else None
    if judges is None:
        yield Grading(limits, embed=embed)
        return
    if not endpoint.inference_server_url:
        raise NoJudgeError(
            "the job's model graders are judged by the serving process, and this worker has none "
            "configured (ZENFLOW_API_INFERENCE_SERVER_URL and ZENFLOW_API_INFERENCE_SERVER_TOKEN)"
        )
    from trainer.graders.serving_judge import ServingJudge

    token = endpoint.inference_server_token.get_secret_value()
    timeout = endpoint.inference_timeout_seconds
    with ServingJudge(endpoint.inference_server_url, token, judges, timeout_seconds=timeout) as judge:
        yield Grading(limits, judge, embed)

"""The Python grader's sandbox limits from the service's settings (``ZENFLOW_PYTHON_GRADER_*``): one
place that turns them into :class:`trainer.graders.sandbox.SandboxLimits`, for the API's grader routes and
a worker's training jobs (``run_training(grader_limits=...)``). The limits not in the settings keep
SandboxLimits' defaults."""

from __future__ import annotations

from store.settings import Settings
from trainer.graders.sandbox import SandboxLimits


def sandbox_limits(settings: Settings) -> SandboxLimits:
    """The limits of one Python grader call on this server."""
    return SandboxLimits(
        cpu_seconds=settings.python_grader_cpu_seconds,
        wall_seconds=settings.python_grader_wall_seconds,
        memory_bytes=settings.python_grader_memory_bytes,
        max_processes=settings.python_grader_max_processes,
        allow_unisolated=settings.python_grader_allow_unisolated,
    )

"""This worker's process template (:mod:`trainer.run.template`): the process its jobs' agents and ranks
fork from instead of importing torch, transformers and the trainer each time.

Started at the first job that may use it (``Settings.process_template``) in that job's environment,
kept for the next ones, and started anew when a job's environment differs in what a rank imports in
(:func:`trainer.run.template.import_env`) or the template has died; the first job's ranks wait for its
preload rather than import beside it. Closed with the worker.
"""

from __future__ import annotations

import threading

from store.settings import Settings
from trainer.run.template import TEMPLATE_ENV, ProcessTemplate
from worker.job.runner import JOB_RUNNER_MODULE
from worker.metrics.server import job_process_exited

#: What a job's agent and runner import that is worth importing once: torch and its distributed, FSDP
#: and elastic parts, transformers' model code, peft, the training loop, the agent and the runner (each
#: run afresh as ``__main__`` in the process forked for it).
PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.launcher.api",
    "trainer.run.agent",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "peft",
    "safetensors.torch",
    "trainer.run.setup",
    "trainer.run.loop",
    JOB_RUNNER_MODULE,
)

_lock = threading.Lock()
_template: ProcessTemplate | None = None


def wanted(settings: Settings, gpus: bool) -> bool:
    """Whether a job's ranks on this worker fork from the template (``gpus``: they run on GPUs)."""
    return settings.process_template == "on" or (settings.process_template == "auto" and not gpus)


def with_template(env: dict[str, str], settings: Settings, *, gpus: bool) -> dict[str, str]:
    """``env`` naming the template that serves ranks started in it (started or replaced as needed),
    or as it is where the ranks are to start their own interpreters."""
    global _template
    env = {k: v for k, v in env.items() if k != TEMPLATE_ENV}
    if not wanted(settings, gpus):
        return env
    with _lock:
        if _template is None or not _template.serves(env):
            if _template is not None:
                _close(_template)
            _template = ProcessTemplate(PRELOAD).start(env)
        env[TEMPLATE_ENV] = _template.path
    return env


def close() -> None:
    """Stop the template (the worker's end)."""
    global _template
    with _lock:
        if _template is not None:
            _close(_template)
            _template = None


def _close(template: ProcessTemplate) -> None:
    pid = template.proc.pid if template.proc is not None else None
    template.close()
    if pid is not None:
        job_process_exited(pid)  # the metric samples of what it imported (none counted)

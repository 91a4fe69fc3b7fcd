"""A job's W&B run (``{"type": "wandb", "wandb": {"project", "name", "entity", "tags"}}``, OpenAI's shape).

With ``Settings.wandb_api_key`` the run goes to the worker's W&B server (``wandb_base_url``, else W&B's
own); without one, or when that server does not answer ``wandb.init`` within
``tracking_request_timeout_seconds`` x 6, the run is written in W&B's offline format under the job's
output (``tracking/wandb/offline-run-*/run-<id>.wandb``, for ``wandb sync``) and a warning says so.
The config holds the job's settings and the resolved hyperparameters, the history every step's metrics
(``worker.tracking.base.STEP_METRICS``, a DPO job's ``dpo_*``; ``valid_loss`` and ``dpo_valid_*`` at
evaluations), the summary the checkpoints'
and the final model's ids. The job process's W&B environment is set here: nothing of it is read from
the user's home, no console capture, no system statistics.
"""

from __future__ import annotations

import os
from typing import Any

from store.model_ids import checkpoint_id
from trainer.events import CheckpointSaved, EvalEvent, Event, RunFinished, RunStarted, StepEvent
from worker.tracking.base import Sink, TrackingContext, Warn, eval_metrics, step_metrics
from worker.tracking.integrations import WandbSettings


class WandbSink(Sink):
    kind = "wandb"

    def __init__(
        self,
        ctx: TrackingContext,
        cfg: WandbSettings,
        *,
        base_url: str,
        api_key: str | None,
        warn: Warn,
        timeout_seconds: float,
    ) -> None:
        self.ctx, self.cfg, self.warn = ctx, cfg, warn
        self.online = bool(api_key)
        self.dir = ctx.tracking_dir
        os.environ.update(
            WANDB_DIR=str(self.dir),
            WANDB_SILENT="true",
            WANDB_MODE="online" if self.online else "offline",
            WANDB_CONSOLE="off",
            WANDB_DISABLE_GIT="true",
        )
        if base_url:
            os.environ["WANDB_BASE_URL"] = base_url
        if api_key:
            os.environ["WANDB_API_KEY"] = api_key
        self.base_url, self.api_key, self.timeout = base_url, api_key, timeout_seconds
        self.run: Any = None
        self.on_cuda = False

    def _settings(self, mode: str) -> Any:
        import wandb

        extra: dict[str, Any] = {"base_url": self.base_url} if self.base_url else {}
        if mode == "online" and self.api_key:
            extra["api_key"] = self.api_key
        return wandb.Settings(
            mode=mode,  # type: ignore[arg-type]
            silent=True,
            console="off",
            disable_git=True,
            save_code=False,
            x_disable_stats=True,
            init_timeout=self.timeout * 6,
            **extra,
        )

    def _init(self, config: dict[str, Any]) -> None:
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        args: dict[str, Any] = dict(
            project=self.cfg.project,
            entity=self.cfg.entity,
            name=self.cfg.name or self.ctx.job_id,
            tags=self.cfg.tags,
            config=config,
            dir=str(self.dir),
            reinit="create_new",
        )
        if self.online:
            try:
                self.run = wandb.init(**args, settings=self._settings("online"))
                return
            except Exception as e:
                self.warn(
                    f"W&B server unreachable ({type(e).__name__}); the run is written offline under the "
                    "job's output for a later `wandb sync`",
                    {"tracking": self.kind, "error_type": type(e).__name__},
                )
        self.run = wandb.init(**args, settings=self._settings("offline"))

    def handle(self, ev: Event) -> None:
        if isinstance(ev, RunStarted):
            self.on_cuda = ev.device.startswith("cuda")
            if self.run is None:
                run = {"device": ev.device, "dtype": ev.dtype, "engine_mode": ev.mode}
                self._init({**self.ctx.params, "resolved": ev.hyperparameters, "run": run})
            return
        if self.run is None:
            return
        if isinstance(ev, StepEvent):
            self.run.log(step_metrics(ev, self.on_cuda), step=ev.step)
        elif isinstance(ev, EvalEvent):
            self.run.log(eval_metrics(ev), step=ev.step)
        elif isinstance(ev, CheckpointSaved):
            self.run.summary[f"checkpoint.{ev.step}"] = checkpoint_id(self.ctx.model_id, ev.step)
        elif isinstance(ev, RunFinished) and not ev.cancelled and ev.final_model_dir:
            self.run.summary["fine_tuned_model"] = self.ctx.model_id
            self.run.summary["trained_tokens"] = ev.trained_tokens

    def close(self, deadline: float, *, succeeded: bool) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if succeeded else 1)
            self.run = None

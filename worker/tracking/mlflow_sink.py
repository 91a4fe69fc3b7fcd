"""A job's run on its team's MLflow tracking server (``{"type": "mlflow", "mlflow": {...}}``).

The run gets the job's settings and the resolved hyperparameters as params, every step's metrics
(``worker.tracking.base.STEP_METRICS``, ``gpu_utilization`` on a GPU, a DPO job's ``dpo_*`` rewards and
preference accuracy, a reinforcement job's ``rft_*`` rewards and ``rft_sub_reward/<grader>``,
``valid_loss``, ``dpo_valid_*`` and ``rft_valid_reward_mean`` at evaluations),
each checkpoint's model id as a tag ``zenflow.checkpoint.<step>``, and the final model's id as the
tag ``zenflow.fine_tuned_model``. Everything is buffered and sent with ``MlflowClient.log_batch`` every
``tracking_flush_seconds`` by the tracking thread; no request is retried inside the client (its
backoff would hold the thread for minutes) and each has ``tracking_request_timeout_seconds``.

A server that is away: one warning event, the buffer kept and sent when it answers again; at the
job's end, what is still unsent after ``tracking_close_seconds`` goes to ``tracking/mlflow-unsent.jsonl``
in the job's output (one JSON object a line: first ``{"run": {experiment, run_name, run_id, tags}}``,
then ``{"param": k, "value": v}``, ``{"tag": k, "value": v}`` and ``{"metric": k, "value": x, "step": n,
"timestamp": ms}``), and a warning names it. A re-run of the job (resumed after a re-queue) logs to
the same MLflow run (its id kept in ``tracking/mlflow-run-id``; the steps it replays from its checkpoint
are logged again at their step numbers). A batch the server refuses (not an outage: a resumed run's
param whose value changed) is dropped with a warning rather than sent again forever.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

from store.model_ids import checkpoint_id
from trainer.events import CheckpointSaved, EvalEvent, Event, RunFinished, RunStarted, StepEvent
from worker.tracking.base import Sink, TrackingContext, Warn, eval_metrics, step_metrics
from worker.tracking.integrations import MlflowSettings

if TYPE_CHECKING:
    from mlflow.entities import Metric

#: MLflow's own limits per log_batch request.
_MAX_PARAMS, _MAX_TAGS, _MAX_METRICS = 100, 100, 1000
_MAX_VALUE = 6000  # a param's value, in characters
#: Metrics held for a server that is away at most; beyond, they go to the offline file at once.
MAX_BUFFERED_METRICS = 200_000
UNSENT_NAME = "mlflow-unsent.jsonl"
#: Refusals a later try may pass (the server's own trouble); any other refusal drops its batch.
_RETRIED = frozenset({"INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED"})
RUN_ID_NAME = "mlflow-run-id"


def _text(v: Any) -> str:
    s = v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)
    return s[:_MAX_VALUE]


def _flat(prefix: str, d: dict[str, Any]) -> dict[str, str]:
    return {f"{prefix}{k}": _text(v) for k, v in d.items() if v is not None}


class MlflowSink(Sink):
    kind = "mlflow"

    def __init__(
        self, ctx: TrackingContext, cfg: MlflowSettings, uri: str, *, warn: Warn, timeout_seconds: float
    ) -> None:
        # The client reads these per request: no retries with backoff, a short timeout (module docstring).
        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
        os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(max(1, round(timeout_seconds)))
        from mlflow import MlflowClient

        self.ctx, self.cfg, self.warn = ctx, cfg, warn
        self.client = MlflowClient(tracking_uri=uri) if uri else None
        self.on_cuda = False
        self.params: dict[str, str] = _flat("", {"job_id": ctx.job_id, **ctx.params})
        self.tags: dict[str, str] = {
            "zenflow.job_id": ctx.job_id,
            "zenflow.team_id": ctx.team_id,
            **(cfg.tags or {}),
        }
        self.metrics: list[Metric] = []
        self.down_since: float | None = None
        self.run_id = self._saved_run_id()
        #: A run of this job made by an earlier attempt (re-queued, resumed): set RUNNING at first send.
        self.reopen = self.run_id is not None

    # -- events -> buffer --

    def handle(self, ev: Event) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        if isinstance(ev, RunStarted):
            self.on_cuda = ev.device.startswith("cuda")
            self.params.update(_flat("hp.", ev.hyperparameters))
            run = {
                "device": ev.device,
                "dtype": ev.dtype,
                "engine_mode": ev.mode,
                "num_parameters": ev.num_parameters,
                "trainable_parameters": ev.trainable_parameters,
                "num_examples": ev.num_examples,
                "num_validation_examples": ev.num_validation_examples,
                "total_steps": ev.total_steps,
            }
            self.params.update(_flat("run.", run))
        elif isinstance(ev, StepEvent):
            for k, v in step_metrics(ev, self.on_cuda).items():
                self.metrics.append(Metric(k, v, now, ev.step))
        elif isinstance(ev, EvalEvent):
            for k, v in eval_metrics(ev).items():
                self.metrics.append(Metric(k, v, now, ev.step))
        elif isinstance(ev, CheckpointSaved):
            self.tags[f"zenflow.checkpoint.{ev.step}"] = checkpoint_id(self.ctx.model_id, ev.step)
        elif isinstance(ev, RunFinished) and not ev.cancelled and ev.final_model_dir:
            self.tags["zenflow.fine_tuned_model"] = self.ctx.model_id
            self.metrics.append(Metric("trained_tokens", float(ev.trained_tokens), now, ev.steps))
        if len(self.metrics) > MAX_BUFFERED_METRICS:
            self._leave_offline("more metrics waited for it than the buffer holds")

    # -- buffer -> server --

    def flush(self) -> None:
        if self.client is None or not (self.params or self.tags or self.metrics or self.run_id is None):
            return
        try:
            self._send()
        except Exception as e:
            if self.down_since is None:
                self.down_since = time.monotonic()
                self.warn(
                    f"MLflow tracking server unreachable ({type(e).__name__}); the run's metrics are kept "
                    "and sent when it answers, training goes on",
                    {"tracking": self.kind, "error_type": type(e).__name__},
                )
            return
        if self.down_since is not None:
            self.down_since = None
            self.warn(
                "MLflow tracking server reachable again: the metrics kept meanwhile were sent",
                {"tracking": self.kind, "run_id": self.run_id},
            )

    def _send(self) -> None:
        """Everything buffered to the server: the run (re)opened or created, then params, tags and
        metrics in batches; what the server refuses for good is said and left out."""
        assert self.client is not None
        if self.reopen and self.run_id is not None:  # the job's earlier run: running again
            self._reopen_run()
        if self.run_id is None:
            self.run_id = self._create_run()
        self._send_params()
        self._send_tags_and_metrics()

    def _reopen_run(self) -> None:
        from mlflow.exceptions import RestException

        assert self.client is not None and self.run_id is not None
        try:
            self.client.update_run(self.run_id, status="RUNNING")
        except RestException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            self.run_id = None  # deleted on the server meanwhile: a new run
        self.reopen = False

    def _send_params(self) -> None:
        """Apart from the metrics: a refused param takes no metric with it."""
        from mlflow.entities import Param

        while self.params:
            chunk = [Param(k, v) for k, v in list(self.params.items())[:_MAX_PARAMS]]
            if self._batch(params=chunk) is not None:  # which ones: one at a time
                refused = [p.key for p in chunk if self._batch(params=[p]) is not None]
                self.warn(
                    f"MLflow refused the params {', '.join(refused[:10])} (a resumed run's changed values "
                    "are kept as first logged); they are left out",
                    {"tracking": self.kind, "params": refused},
                )
            for p in chunk:
                del self.params[p.key]

    def _send_tags_and_metrics(self) -> None:
        from mlflow.entities import RunTag

        while self.tags or self.metrics:
            tags, metrics = list(self.tags.items())[:_MAX_TAGS], self.metrics[:_MAX_METRICS]
            if (code := self._batch(tags=[RunTag(k, v) for k, v in tags], metrics=metrics)) is not None:
                self.warn(
                    f"MLflow refused {len(tags)} tags and {len(metrics)} metrics ({code}); they are left out",
                    {"tracking": self.kind, "error_code": code},
                )
            for k, _ in tags:
                del self.tags[k]
            del self.metrics[: len(metrics)]

    def _batch(self, *, params: Any = (), tags: Any = (), metrics: Any = ()) -> str | None:
        """One ``log_batch``: None when sent, the error code of a refusal the server will repeat (not an
        outage: a resumed run's param whose value changed, a value over its limits); raises otherwise."""
        from mlflow.exceptions import RestException

        assert self.client is not None and self.run_id is not None
        try:
            self.client.log_batch(self.run_id, metrics=metrics, params=params, tags=tags, synchronous=True)
        except RestException as e:
            if e.error_code in _RETRIED:
                raise
            return str(e.error_code)
        return None

    def _create_run(self) -> str:
        assert self.client is not None
        exp = self.client.get_experiment_by_name(self.cfg.experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(self.cfg.experiment)
        run = self.client.create_run(exp_id, run_name=self.cfg.run_name or self.ctx.job_id)
        run_id: str = run.info.run_id
        try:
            self.ctx.tracking_dir.mkdir(parents=True, exist_ok=True)
            (self.ctx.tracking_dir / RUN_ID_NAME).write_text(run_id)
        except OSError:
            pass  # a resumed run then starts a new MLflow run: no loss of what this one sends
        return run_id

    def _saved_run_id(self) -> str | None:
        try:
            return (self.ctx.tracking_dir / RUN_ID_NAME).read_text().strip() or None
        except OSError:
            return None

    # -- the end --

    def close(self, deadline: float, *, succeeded: bool) -> None:
        while self.client is not None:
            self.flush()
            if self.down_since is None:
                if self.run_id is not None:
                    self.client.set_terminated(self.run_id, "FINISHED" if succeeded else "FAILED")
                return
            if time.monotonic() + 1.0 >= deadline:
                break
            time.sleep(1.0)
        why = "no MLflow tracking server is configured" if self.client is None else "the server is away"
        self._leave_offline(why)

    def _leave_offline(self, why: str) -> None:
        """Append what is unsent to ``tracking/mlflow-unsent.jsonl`` (module docstring) and say so."""
        path = self.ctx.tracking_dir / UNSENT_NAME
        run = {"experiment": self.cfg.experiment, "run_name": self.cfg.run_name or self.ctx.job_id}
        lines: list[dict[str, Any]] = [{"run": {**run, "run_id": self.run_id}}]
        lines += [{"param": k, "value": v} for k, v in self.params.items()]
        lines += [{"tag": k, "value": v} for k, v in self.tags.items()]
        lines += [
            {"metric": m.key, "value": m.value, "step": m.step, "timestamp": m.timestamp}
            for m in self.metrics
        ]
        count = len(self.metrics)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.writelines(json.dumps(line) + "\n" for line in lines)
        except OSError as e:
            self.warn(
                f"MLflow tracking: {count} metrics could not be kept ({why}; {type(e).__name__})",
                {"tracking": self.kind},
            )
            return
        finally:
            self.params, self.tags, self.metrics = {}, {}, []
        self.warn(
            f"MLflow tracking: {why}; {count} metrics left in {path} for a later import",
            {"tracking": self.kind, "path": str(path), "metrics": count},
        )

"""A job process's tracking, from its row: :func:`open_tracking` for rank 0 of ``worker.job.runner``.

Reads the job's stored ``integrations`` and what the runs are to record (its settings, its final
model's ``ft:`` id), builds one sink per integration against the worker's settings (the team's MLflow
server, W&B's server and key) and returns the :class:`~worker.tracking.base.Tracking` that feeds them.
Their warnings are job events written by the job's :class:`~worker.job.writer.ReportWriter`. Nothing
here may stop the job: a row that cannot be read or an integration that cannot start is a warning.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from store import model_ids
from store.db import session_scope
from store.orm import FineTuningJob
from store.settings import Settings
from worker.job.writer import ReportWriter, Write, event_row
from worker.retry import retry_db
from worker.tracking.base import Sink, Tracking, TrackingContext, Warn
from worker.tracking.integrations import MlflowIntegration, WandbIntegration, parse_stored

log = logging.getLogger("zenflow.tracking")

#: How long reading the job row for its integrations may wait out a database outage.
_LOAD_SECONDS = 30.0


def _settings(job: FineTuningJob) -> dict[str, Any]:
    """The job's settings as resolved (its request's, for a job not resolved yet)."""
    if job.resolution is not None:
        resolved = job.resolution.job
        return {
            "method": resolved.method.model_dump(mode="json"),
            "hyperparameters": resolved.hyperparameters.model_dump(mode="json"),
            "engine": resolved.engine.model_dump(mode="json"),
            "resources": resolved.resources.model_dump(mode="json"),
        }
    return job.request.model_dump(mode="json", include={"method", "hyperparameters", "engine", "resources"})


def _load(url: str, job_id: str, output_dir: Path) -> tuple[list[Any], TrackingContext] | None:
    with session_scope(url) as s:
        job = s.get(FineTuningJob, job_id)
        if job is None or not job.integrations:
            return None
        params = {
            "model": job.model,
            "training_file": job.training_file_id,
            "validation_file": job.validation_file_id,
            "seed": job.seed,
            "suffix": job.suffix,
            **_settings(job),
        }
        ctx = TrackingContext(job.id, job.team_id, model_ids.job_model_id(s, job), output_dir, params)
        return list(job.integrations), ctx


def open_tracking(
    url: str, job_id: str, settings: Settings, writer: ReportWriter, output_dir: Path
) -> Tracking:
    """The job's tracking (no sinks when it names no integration); started, to be closed by the caller."""

    def warn(message: str, data: dict[str, Any]) -> None:
        log.warning("job %s: %s", job_id, message)
        writer.put(Write(events=[event_row(message, level="warning", data=data)]))

    def tracking(sinks: list[Sink]) -> Tracking:
        return Tracking(
            sinks,
            warn=warn,
            max_items=settings.tracking_queue_items,
            flush_seconds=settings.tracking_flush_seconds,
            # the job's end waits on it with no heartbeat beating: well within the heartbeat's timeout
            close_seconds=min(settings.tracking_close_seconds, settings.heartbeat_timeout_seconds / 3),
        )

    try:
        loaded = retry_db(
            lambda: _load(url, job_id, output_dir), window=_LOAD_SECONDS, what=f"job {job_id}: integrations"
        )
    except Exception as e:
        warn(f"Tracking is off for this run: its integrations could not be read ({type(e).__name__})", {})
        return tracking([])
    if loaded is None:
        return tracking([])
    rows, ctx = loaded
    sinks: list[Sink] = []
    try:
        integrations = parse_stored(rows)
    except ValueError as e:
        warn(f"Tracking is off for this run: its integrations are not understood here ({e})", {})
        return tracking([])
    for item in integrations:
        try:
            sinks.append(_sink(item, ctx, settings, warn))
        except Exception as e:
            log.exception("job %s: tracking %s", job_id, item.type)
            warn(
                f"Tracking ({item.type}) could not start ({type(e).__name__}); training goes on",
                {"tracking": item.type, "error_type": type(e).__name__},
            )
    return tracking(sinks)


def _sink(
    item: MlflowIntegration | WandbIntegration, ctx: TrackingContext, settings: Settings, warn: Warn
) -> Sink:
    timeout = settings.tracking_request_timeout_seconds
    if isinstance(item, MlflowIntegration):
        from worker.tracking.mlflow_sink import MlflowSink

        uri = settings.mlflow_uri_for(ctx.team_id)
        return MlflowSink(ctx, item.mlflow, uri, warn=warn, timeout_seconds=timeout)
    from worker.tracking.wandb_sink import WandbSink

    key = settings.wandb_api_key.get_secret_value() if settings.wandb_api_key else None
    return WandbSink(
        ctx, item.wandb, base_url=settings.wandb_base_url, api_key=key, warn=warn, timeout_seconds=timeout
    )

"""Training-side Prometheus metrics: the engine's per-step records of the job a worker runs.

The process that trains (``python -m worker.job.runner JOB_ID``) holds a
:class:`WorkerTelemetry` (:func:`worker_telemetry`) and runs the job inside :func:`track_job`, which
feeds it every training event. Its samples reach the worker's /metrics
(:mod:`worker.metrics.server`) through prometheus-client's multiprocess files; without
``PROMETHEUS_MULTIPROC_DIR`` (tests, a job trained in-process) they live in an ordinary registry.

Labels are bounded: ``worker``, ``hostname``, ``gpu`` (the physical index, as in DCGM exporter's
``gpu`` label, so panels can join on it), ``base_model``, ``mode``, ``direction``, ``kind``,
``status``. No long-lived series carries a job id; the one exception is the info-style gauge
``zenflow_worker_current_job{job_id}``, which is 1 only while that job runs on the worker and is
removed when it ends (in multiprocess mode: when the job process is reported dead), so a per-job
Grafana view joins on it (``* on(worker, gpu) group_left(job_id) zenflow_worker_current_job``).
Per-job history after the job ends is served by the API from the database (JobStepMetric rows).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.registry import REGISTRY

from offload.step_metrics import StepMetrics
from trainer.events import ErrorEvent, EvalEvent, Event, RewardMetrics, RunFinished, RunStarted, StepEvent
from worker.metrics.multiprocess import multiprocess_mode
from worker.metrics.nvml import detect_gpu

log = logging.getLogger(__name__)

BASE_LABELS = ("worker", "hostname", "gpu")
STEP_LABELS = (*BASE_LABELS, "base_model", "mode")

# A step is tens of milliseconds (a tiny model) to a minute (a 13B model offloaded on one GPU).
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
# Stalls are often zero (zenflow mode) and seconds at worst (synchronous offload of a large model).
STALL_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
CPU_OPT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

DIRECTIONS = ("device_to_host", "host_to_device")


def this_host() -> str:
    return socket.gethostname()


def default_worker_name() -> str:
    """``ZENFLOW_WORKER_NAME`` or the hostname (the same in the worker and its job subprocess)."""
    from store.settings import get_settings

    return get_settings().worker_name or this_host()


def _dpo_gauges(registry: CollectorRegistry) -> dict[str, Gauge]:
    """A DPO job's last step (trainer.events.PreferenceMetrics): rewards in nats x beta, accuracy a ratio."""
    return {
        name: Gauge(
            metric,
            text,
            STEP_LABELS,
            registry=registry,
            multiprocess_mode="livemostrecent",
        )
        for name, metric, text in (
            ("chosen_reward", "zenflow_dpo_chosen_reward", "DPO: mean reward of the chosen completions."),
            ("rejected_reward", "zenflow_dpo_rejected_reward", "DPO: mean reward of the rejected ones."),
            ("reward_margin", "zenflow_dpo_reward_margin", "DPO: mean chosen minus rejected reward."),
            (
                "accuracy",
                "zenflow_dpo_preference_accuracy_ratio",
                "DPO: share of the last step's pairs whose chosen reward beats the rejected one's.",
            ),
            (
                "valid_accuracy",
                "zenflow_dpo_valid_preference_accuracy_ratio",
                "DPO: preference accuracy on the validation pairs at the last evaluation.",
            ),
        )
    }


def _rft_gauges(registry: CollectorRegistry) -> dict[str, Gauge]:
    """A reinforcement job's last step and evaluation (trainer.events.RewardMetrics): the graders' rewards
    and the completions' mean length (no grader name is a label: the sub-rewards go to the trackers)."""
    return {
        name: Gauge(metric, text, STEP_LABELS, registry=registry, multiprocess_mode="livemostrecent")
        for name, metric, text in (
            ("reward_mean", "zenflow_rft_reward_mean", "RFT: mean reward of the last step's completions."),
            ("reward_min", "zenflow_rft_reward_min", "RFT: lowest reward of the last step's completions."),
            ("reward_max", "zenflow_rft_reward_max", "RFT: highest reward of the last step's completions."),
            (
                "completion_tokens_mean",
                "zenflow_rft_completion_tokens_mean",
                "RFT: mean tokens of the last step's sampled completions.",
            ),
            (
                "valid_reward_mean",
                "zenflow_rft_valid_reward_mean",
                "RFT: mean reward on the validation prompts at the last evaluation.",
            ),
        )
    }


def _rft_counters(registry: CollectorRegistry) -> dict[str, Counter]:
    """A reinforcement job's steps, summed: completions whose grading failed, and the time spent sampling
    and grading (rate() against zenflow_step_seconds gives their share of a step)."""
    return {
        name: Counter(metric, text, STEP_LABELS, registry=registry)
        for name, metric, text in (
            (
                "grader_errors",
                "zenflow_rft_grader_errors",
                "RFT: completions whose grader set an error flag.",
            ),
            (
                "generation_seconds",
                "zenflow_rft_generation_seconds",
                "RFT: time spent sampling completions, summed over steps.",
            ),
            ("grading_seconds", "zenflow_rft_grading_seconds", "RFT: time spent grading, summed over steps."),
        )
    }


class WorkerTelemetry:
    """Prometheus metrics of one worker (one GPU), fed by the engine's per-step records.

    ``registry`` defaults to prometheus-client's global registry; in multiprocess mode (the variable
    ``PROMETHEUS_MULTIPROC_DIR`` set before prometheus_client was imported) samples go to the mmap
    files whatever the registry.
    """

    def __init__(
        self,
        worker: str,
        gpu: str | int,
        registry: CollectorRegistry | None = None,
        *,
        hostname: str | None = None,
    ) -> None:
        self.worker = str(worker)
        self.gpu = str(gpu)
        self.hostname = hostname or this_host()
        self.registry = REGISTRY if registry is None else registry
        self._base = (self.worker, self.hostname, self.gpu)
        self._lock = threading.Lock()
        self._job: tuple[str, str, str] | None = None  # (job_id, base_model, mode)
        self._step_labelsets: set[tuple[str, ...]] = set()
        self._mem_kinds: set[str] = set()
        self._make_step_metrics(self.registry)
        self._make_gauges(self.registry)
        self._make_job_metrics(self.registry)

    def _make_step_metrics(self, r: CollectorRegistry) -> None:
        """Histograms and counters of the steps: time, stalls, CPU optimizer, transfers, tokens, skips."""
        self.step_seconds = Histogram(
            "zenflow_step_seconds",
            "Wall time of one training step (engine.step to engine.step).",
            STEP_LABELS,
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.step_stall_seconds = Histogram(
            "zenflow_step_stall_seconds",
            "Time one step's training thread was blocked on the CPU optimizer or on transfers.",
            STEP_LABELS,
            buckets=STALL_BUCKETS,
            registry=r,
        )
        self.stall_seconds = Counter(
            "zenflow_stall_seconds", "Training-thread stall time, summed over steps.", STEP_LABELS, registry=r
        )
        self.cpu_optimizer_step_seconds = Histogram(
            "zenflow_cpu_optimizer_step_seconds",
            "Time of one CPU optimizer update (observed at the steps where one finished or ran).",
            STEP_LABELS,
            buckets=CPU_OPT_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Counter(
            "zenflow_offload_transfer_bytes",
            "Bytes moved between device and host by the offload engine.",
            (*STEP_LABELS, "direction"),
            registry=r,
        )
        self.tokens = Counter(
            "zenflow_tokens",
            "Training tokens processed (rate() gives tokens per second).",
            STEP_LABELS,
            registry=r,
        )
        self.steps_skipped = Counter(
            "zenflow_steps_skipped",
            "Steps the engine skipped because the global gradient norm was not finite (nothing updated).",
            STEP_LABELS,
            registry=r,
        )

    def _make_gauges(self, r: CollectorRegistry) -> None:
        """The running job's last values: losses, DPO rewards, utilization, memory."""
        self.train_loss = Gauge(
            "zenflow_train_loss",
            "Training loss of the last step of the running job.",
            STEP_LABELS,
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.dpo = _dpo_gauges(r)
        self.rft = _rft_gauges(r)
        self.rft_totals = _rft_counters(r)
        self.gpu_utilization = Gauge(
            "zenflow_gpu_utilization_ratio",
            "Share of the last step the device computed rather than waited (compute / wall).",
            STEP_LABELS,
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.device_memory = Gauge(
            "zenflow_device_memory_bytes",
            "Device memory: optimizer_state (the engine's moments and buffers), allocated/reserved "
            "(torch caching allocator), used/total (NVML, whole device).",
            (*BASE_LABELS, "kind"),
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.engine_host_memory = Gauge(
            "zenflow_engine_host_memory_bytes",
            "Host memory the running job's optimizer engine holds (page-locked on CUDA): fp32 master "
            "weights and moments, gradient accumulators and transfer buffers.",
            BASE_LABELS,
            registry=r,
            multiprocess_mode="livemostrecent",
        )

    def _make_job_metrics(self, r: CollectorRegistry) -> None:
        """The job running on the worker, and the jobs that ended there."""
        self.current_job = Gauge(
            "zenflow_worker_current_job",
            "1 while the job named by job_id runs on this worker (info-style; removed when it ends).",
            (*BASE_LABELS, "job_id", "base_model", "mode"),
            registry=r,
            multiprocess_mode="livemax",
        )
        self.jobs_finished = Counter(
            "zenflow_worker_jobs",
            "Jobs that ended on this worker, by how they ended.",
            (*BASE_LABELS, "status"),
            registry=r,
        )

    # -- job lifecycle ---------------------------------------------------------------------------

    def job_started(self, job_id: str, *, base_model: str, mode: str) -> None:
        with self._lock:
            if self._job is not None:
                self._clear_job_locked()
            self._job = (str(job_id), model_label(base_model), str(mode))
            self.current_job.labels(*self._base, *self._job).set(1)

    def job_finished(self, status: str | None) -> None:
        """The running job ended (``succeeded``, ``failed``, ``cancelled``, ``paused`` or ``interrupted``;
        None: not counted here, as on a job's ranks > 0, whose rank 0 counts it)."""
        with self._lock:
            if status is not None:
                self.jobs_finished.labels(*self._base, str(status)).inc()
            self._clear_job_locked()

    def _clear_job_locked(self) -> None:
        if self._job is not None:
            # What a multiprocess reader sees until the dead pid's files are dropped by the server.
            self.current_job.labels(*self._base, *self._job).set(0)
        if not multiprocess_mode():  # (prometheus-client cannot remove label sets from mmap files)
            if self._job is not None:
                with contextlib.suppress(KeyError):
                    self.current_job.remove(*self._base, *self._job)
            for ls in self._step_labelsets:
                for g in (self.train_loss, self.gpu_utilization, *self.dpo.values(), *self.rft.values()):
                    with contextlib.suppress(KeyError):
                        g.remove(*ls)
            for kind in self._mem_kinds:
                with contextlib.suppress(KeyError):
                    self.device_memory.remove(*self._base, kind)
            with contextlib.suppress(KeyError):
                self.engine_host_memory.remove(*self._base)
        self._step_labelsets.clear()
        self._mem_kinds.clear()
        self._job = None

    # -- steps -----------------------------------------------------------------------------------

    def observe_step(
        self, metrics: StepMetrics, *, tokens: int, loss: float | None, base_model: str, mode: str
    ) -> None:
        """Record one engine step (call once per ``engine.step()``)."""
        ls = (*self._base, model_label(base_model), str(mode))
        wall = max(float(metrics.wall_seconds), 0.0)
        stall = max(float(metrics.stall_seconds), 0.0)
        if wall > 0:
            stall = min(stall, wall)
        with self._lock:
            self._step_labelsets.add(ls)
            self.step_seconds.labels(*ls).observe(wall)
            self.step_stall_seconds.labels(*ls).observe(stall)
            self.stall_seconds.labels(*ls).inc(stall)
            if metrics.cpu_optimizer_seconds > 0:
                self.cpu_optimizer_step_seconds.labels(*ls).observe(float(metrics.cpu_optimizer_seconds))
            d2h = self.transfer_bytes.labels(*ls, "device_to_host")
            h2d = self.transfer_bytes.labels(*ls, "host_to_device")
            d2h.inc(max(int(metrics.bytes_device_to_host), 0))
            h2d.inc(max(int(metrics.bytes_host_to_device), 0))
            self.tokens.labels(*ls).inc(max(int(tokens), 0))
            skipped = self.steps_skipped.labels(*ls)
            if metrics.skipped:
                skipped.inc()
            if loss is not None and math.isfinite(float(loss)):
                self.train_loss.labels(*ls).set(float(loss))
            self.gpu_utilization.labels(*ls).set(1.0 - stall / wall if wall > 0 else 0.0)
            self._set_memory("optimizer_state", metrics.device_optimizer_state_bytes)
            self.engine_host_memory.labels(*self._base).set(int(metrics.host_bytes))
            for kind, value in _torch_cuda_memory().items():
                self._set_memory(kind, value)

    def on_event(self, event: Event) -> None:
        """Feed one :mod:`trainer.events` event (the job runner forwards every ``on_event`` to this).

        A :class:`~trainer.events.StepEvent` becomes :meth:`observe_step` of the engine record it
        carries; :class:`~trainer.events.RunStarted` refines the job's mode; the rest is ignored.
        Never raises: a metrics problem must not abort a training run.
        """
        try:
            if isinstance(event, RunStarted):
                self._set_mode(event.mode)
            elif isinstance(event, StepEvent):
                self._on_step(event)
            elif isinstance(event, EvalEvent):
                self._on_eval(event)
        except Exception:
            log.exception("telemetry: could not record %s", type(event).__name__)

    def _labels(self) -> tuple[str, str]:
        return ("unknown", "unknown") if self._job is None else (self._job[1], self._job[2])

    def _on_step(self, event: StepEvent) -> None:
        if event.engine.mode:  # the engine's resolved mode (ranks > 0 see no RunStarted)
            self._set_mode(event.engine.mode)
        base_model, mode = self._labels()
        tokens = event.tokens if event.rank_tokens is None else event.rank_tokens  # a rank: its own
        self.observe_step(event.engine, tokens=int(tokens), loss=event.loss, base_model=base_model, mode=mode)
        if event.preference is not None:
            self._observe_preference(asdict(event.preference), base_model, mode)
        if event.reward is not None:
            self._observe_reward(event.reward, base_model, mode)

    def _on_eval(self, event: EvalEvent) -> None:
        base_model, mode = self._labels()
        if event.preference is not None:
            self._observe_preference({"valid_accuracy": event.preference.accuracy}, base_model, mode)
        if event.reward is not None:
            self._set_gauges(self.rft, {"valid_reward_mean": event.reward.reward_mean}, base_model, mode)

    def _observe_preference(self, values: dict[str, float], base_model: str, mode: str) -> None:
        self._set_gauges(self.dpo, values, base_model, mode)

    def _observe_reward(self, r: RewardMetrics, base_model: str, mode: str) -> None:
        """A reinforcement step's rewards and lengths (gauges), its grader errors and times (counters)."""
        figures = asdict(r)
        self._set_gauges(self.rft, {k: figures[k] for k in self.rft if k in figures}, base_model, mode)
        ls = (*self._base, model_label(base_model), str(mode))
        with self._lock:
            for name, counter in self.rft_totals.items():
                value = float(figures[name])
                if math.isfinite(value) and value > 0:
                    counter.labels(*ls).inc(value)

    def _set_gauges(
        self, gauges: dict[str, Gauge], values: dict[str, float], base_model: str, mode: str
    ) -> None:
        ls = (*self._base, model_label(base_model), str(mode))
        with self._lock:
            self._step_labelsets.add(ls)
            for name, value in values.items():
                if math.isfinite(value):
                    gauges[name].labels(*ls).set(value)

    def _set_mode(self, mode: str) -> None:
        with self._lock:
            if self._job is None or not mode or self._job[2] == mode:
                return
            job_id, base_model, _ = self._job
            self.current_job.labels(*self._base, *self._job).set(0)
            if not multiprocess_mode():
                with contextlib.suppress(KeyError):
                    self.current_job.remove(*self._base, *self._job)
            self._job = (job_id, base_model, str(mode))
            self.current_job.labels(*self._base, *self._job).set(1)

    def _set_memory(self, kind: str, value: int) -> None:
        self._mem_kinds.add(kind)
        self.device_memory.labels(*self._base, kind).set(int(value))


def _torch_cuda_memory() -> dict[str, int]:
    """Allocator figures when this process already uses CUDA (torch is never imported here)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    try:
        if not torch.cuda.is_initialized():
            return {}
        return {
            "allocated": int(torch.cuda.memory_allocated()),
            "reserved": int(torch.cuda.memory_reserved()),
        }
    except Exception:
        return {}


_TELEMETRY: WorkerTelemetry | None = None
_TELEMETRY_LOCK = threading.Lock()


def gpu_label() -> str:
    """This process's ``gpu`` label: its GPU's physical index (:func:`~worker.metrics.nvml.detect_gpu`:
    each rank of a multi-GPU job sees only its own GPU), or for a CPU rank of a multi-rank job its rank
    number (bounded by the job's size), else ``"none"``."""
    gpu = detect_gpu()
    if gpu == "none":
        world, rank = os.environ.get("WORLD_SIZE", ""), os.environ.get("RANK", "")
        if world.isdigit() and int(world) > 1 and rank.isdigit():
            return rank
    return gpu


def worker_telemetry() -> WorkerTelemetry:
    """This process's telemetry (global registry; worker name from settings, gpu label per rank)."""
    global _TELEMETRY
    with _TELEMETRY_LOCK:
        if _TELEMETRY is None:
            _TELEMETRY = WorkerTelemetry(default_worker_name(), gpu_label())
        return _TELEMETRY


def model_label(model: str) -> str:
    """A bounded ``base_model`` label: a built-in name as is, a local checkpoint directory by its name."""
    m = str(model).rstrip("/")
    return Path(m).name if ("/" in m or os.sep in m) else m


class TrackedJob:
    """What :func:`track_job` yields: ``wrap(callback)`` tees every training event into the telemetry and
    remembers how the run ended (RunFinished -> succeeded/cancelled, or paused when ``paused()`` says a
    user's pause stopped it; ErrorEvent -> failed)."""

    def __init__(self, telemetry: WorkerTelemetry, paused: Callable[[], bool] | None = None) -> None:
        self.telemetry = telemetry
        self.status: str | None = None
        self.paused = paused

    def on_event(self, event: Event) -> None:
        if isinstance(event, RunFinished):
            stopped = "paused" if self.paused is not None and self.paused() else "cancelled"
            self.status = stopped if event.cancelled else "succeeded"
        elif isinstance(event, ErrorEvent):
            self.status = "failed"
        self.telemetry.on_event(event)

    def wrap(self, callback: Callable[[Event], None] | None = None) -> Callable[[Event], None]:
        def on_event(event: Event) -> None:
            if callback is not None:
                callback(event)
            self.on_event(event)

        return on_event


@contextlib.contextmanager
def track_job(
    job_id: str,
    *,
    base_model: str,
    mode: str,
    telemetry: WorkerTelemetry | None = None,
    count: bool = True,
    paused: Callable[[], bool] | None = None,
) -> Iterator[TrackedJob]:
    """Telemetry of one job run, for the job runner::

        with track_job(job.id, base_model=spec.model, mode=resolution.job.engine.mode) as tj:
            result = run_training(spec, on_event=tj.wrap(reporter), should_cancel=...)

    ``zenflow_worker_current_job`` is 1 inside the block; on the way out the job is counted in
    ``zenflow_worker_jobs_total{status}`` (failed on an exception, ``interrupted`` when the run
    stopped without finishing, e.g. preempted; ``paused`` for a run a user's pause stopped, which
    RunFinished reports as cancelled: the runner passes ``paused``); ``count=False`` (a job's ranks > 0, which see neither
    RunFinished nor its end state) does not count it. Telemetry problems never break the run.
    """
    tel = telemetry or worker_telemetry()
    tj = TrackedJob(tel, paused)
    try:
        tel.job_started(job_id, base_model=base_model, mode=mode)
    except Exception:
        log.exception("telemetry: job_started failed")
    ok = False
    try:
        yield tj
        ok = True
    finally:
        status = (tj.status or ("interrupted" if ok else "failed")) if count else None
        try:
            tel.job_finished(status)
        except Exception:
            log.exception("telemetry: job_finished failed")

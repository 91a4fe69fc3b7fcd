"""Worker telemetry: the engine's per-step records as Prometheus metrics, served by each worker.

Two roles, usually in two processes:

* The process that trains (``python -m trainer.job_runner JOB_ID``) holds a :class:`WorkerTelemetry`
  (:func:`worker_telemetry`) and calls :meth:`~WorkerTelemetry.job_started`, then
  :meth:`~WorkerTelemetry.observe_step` once per engine step, then :meth:`~WorkerTelemetry.job_finished`.
* The long-lived Celery worker process serves ``/metrics`` on its own port
  (:func:`serve_worker_metrics`, port ``ZENFLOW_WORKER_METRICS_PORT``) and tells the telemetry when a
  job subprocess has exited (:func:`job_process_exited`).

They meet through prometheus-client's multiprocess mode: :func:`serve_worker_metrics` sets
``PROMETHEUS_MULTIPROC_DIR`` (wiped at start) before any job subprocess is spawned, so the job
process writes its samples into mmap files there and the server merges them at scrape time, together
with NVML readings taken at scrape time (the serving process never touches CUDA). Without the
variable (tests, a job trained in-process) the metrics live in an ordinary registry.

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
import dataclasses
import fcntl
import functools
import glob
import logging
import math
import os
import socket
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, values
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import REGISTRY, Collector

from offload.metrics import StepMetrics

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

BASE_LABELS = ("worker", "hostname", "gpu")
STEP_LABELS = (*BASE_LABELS, "base_model", "mode")

# A step is tens of milliseconds (a tiny model) to a minute (a 13B model offloaded on one GPU).
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
# Stalls are often zero (zenflow mode) and seconds at worst (synchronous offload of a large model).
STALL_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
CPU_OPT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

DIRECTIONS = ("device_to_host", "host_to_device")


def _hostname() -> str:
    return socket.gethostname()


def default_worker_name() -> str:
    """``ZENFLOW_WORKER_NAME`` or the hostname (the same in the worker and its job subprocess)."""
    from store.settings import get_settings

    return get_settings().worker_name or _hostname()


# --------------------------------------------------------------------------------------------------
# NVML (nvidia-ml-py): optional, guarded; never initializes CUDA.


class Nvml:
    """Lazily initialized NVML access; every failure means "no GPU readings", never an error."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ok: bool | None = None
        self._mod: Any = None

    def available(self) -> bool:
        with self._lock:
            if self._ok is None:
                try:
                    import pynvml

                    pynvml.nvmlInit()
                    self._mod = pynvml
                    self._ok = pynvml.nvmlDeviceGetCount() > 0
                except Exception as e:  # library missing, no driver, no device
                    log.debug("NVML unavailable: %s", e)
                    self._ok = False
            return self._ok

    def index_of_uuid(self, uuid: str) -> int | None:
        if not self.available():
            return None
        try:
            return int(self._mod.nvmlDeviceGetIndex(self._mod.nvmlDeviceGetHandleByUUID(uuid)))
        except Exception:
            return None

    def uuid(self, index: int) -> str | None:
        if not self.available():
            return None
        try:
            u = self._mod.nvmlDeviceGetUUID(self._mod.nvmlDeviceGetHandleByIndex(index))
            return u.decode() if isinstance(u, bytes) else str(u)
        except Exception:
            return None

    def sample(self, index: int) -> tuple[float, int, int] | None:
        """(utilization ratio 0..1, memory used bytes, memory total bytes) of device ``index``."""
        if not self.available():
            return None
        try:
            h = self._mod.nvmlDeviceGetHandleByIndex(index)
            util = self._mod.nvmlDeviceGetUtilizationRates(h)
            mem = self._mod.nvmlDeviceGetMemoryInfo(h)
            return float(util.gpu) / 100.0, int(mem.used), int(mem.total)
        except Exception as e:
            log.debug("NVML sample of gpu %s failed: %s", index, e)
            return None


NVML = Nvml()


def nvml_index(nvml: Nvml | None = None) -> int | None:
    """Index, in this process's NVML enumeration, of the device this worker trains on (None: no GPU).

    From the first entry of ``CUDA_VISIBLE_DEVICES`` (an index, or a GPU-/MIG- UUID resolved through
    NVML); unset means device 0 when NVML sees a GPU.
    """
    nvml = nvml or NVML
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        first = cvd.split(",")[0].strip()
        if not first or first == "-1":
            return None
        if first.isdigit():
            return int(first)
        return nvml.index_of_uuid(first)
    return 0 if nvml.available() else None


def detect_gpu(nvml: Nvml | None = None) -> str:
    """The ``gpu`` label: the physical GPU index, as DCGM exporter labels it, or ``"none"``.

    In a container given one GPU (``NVIDIA_VISIBLE_DEVICES=3``) NVML numbers it 0 but the host, and
    so DCGM, calls it 3: a single index there wins. Otherwise the NVML index of :func:`nvml_index`.
    For an exact join whatever the numbering, ``zenflow_worker_info`` carries ``gpu_uuid`` (DCGM's
    ``UUID``).
    """
    nvd = os.environ.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if nvd.isdigit():
        return nvd
    idx = nvml_index(nvml)
    return str(idx) if idx is not None else "none"


# --------------------------------------------------------------------------------------------------
# The training side.


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
        self.hostname = hostname or _hostname()
        self.registry = REGISTRY if registry is None else registry
        self._base = (self.worker, self.hostname, self.gpu)
        self._lock = threading.Lock()
        self._job: tuple[str, str, str] | None = None  # (job_id, base_model, mode)
        self._step_labelsets: set[tuple[str, ...]] = set()
        self._mem_kinds: set[str] = set()
        r = self.registry

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
        self.train_loss = Gauge(
            "zenflow_train_loss",
            "Training loss of the last step of the running job.",
            STEP_LABELS,
            registry=r,
            multiprocess_mode="livemostrecent",
        )
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

    def job_finished(self, status: str) -> None:
        """The running job ended (``succeeded``, ``failed``, ``cancelled`` or ``interrupted``)."""
        with self._lock:
            self.jobs_finished.labels(*self._base, str(status)).inc()
            self._clear_job_locked()

    def _clear_job_locked(self) -> None:
        if self._job is not None:
            # What a multiprocess reader sees until the dead pid's files are dropped by the server.
            self.current_job.labels(*self._base, *self._job).set(0)
        if not _multiprocess():  # (prometheus-client cannot remove label sets from mmap files)
            if self._job is not None:
                with contextlib.suppress(KeyError):
                    self.current_job.remove(*self._base, *self._job)
            for ls in self._step_labelsets:
                for g in (self.train_loss, self.gpu_utilization):
                    with contextlib.suppress(KeyError):
                        g.remove(*ls)
            for kind in self._mem_kinds:
                with contextlib.suppress(KeyError):
                    self.device_memory.remove(*self._base, kind)
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
            if loss is not None and math.isfinite(float(loss)):
                self.train_loss.labels(*ls).set(float(loss))
            self.gpu_utilization.labels(*ls).set(1.0 - stall / wall if wall > 0 else 0.0)
            self._set_memory("optimizer_state", metrics.device_optimizer_state_bytes)
            for kind, value in _torch_cuda_memory().items():
                self._set_memory(kind, value)

    def on_event(self, event: Any) -> None:
        """Feed one :mod:`trainer.events` event (the job runner forwards every ``on_event`` to this).

        ``step`` events become :meth:`observe_step` (the engine record is rebuilt from the event's
        ``engine`` dict); ``run_started`` refines the job's mode; the rest is ignored. Never raises:
        a metrics problem must not abort a training run.
        """
        try:
            etype = getattr(event, "type", None)
            if etype == "run_started":
                with self._lock:
                    if self._job is not None and getattr(event, "mode", None):
                        job_id, base_model, mode = self._job
                        if mode != event.mode:
                            self.current_job.labels(*self._base, *self._job).set(0)
                            if not _multiprocess():
                                with contextlib.suppress(KeyError):
                                    self.current_job.remove(*self._base, *self._job)
                            self._job = (job_id, base_model, str(event.mode))
                            self.current_job.labels(*self._base, *self._job).set(1)
            elif etype == "step":
                base_model, mode = ("unknown", "unknown") if self._job is None else self._job[1:]
                self.observe_step(
                    step_metrics_from_dict(
                        event.engine, step=event.step, wall=event.step_seconds, stall=event.stall_seconds
                    ),
                    tokens=int(event.tokens),
                    loss=event.loss,
                    base_model=base_model,
                    mode=mode,
                )
        except Exception:
            log.exception("telemetry: could not record %r", getattr(event, "type", event))

    def _set_memory(self, kind: str, value: int) -> None:
        self._mem_kinds.add(kind)
        self.device_memory.labels(*self._base, kind).set(int(value))


_STEP_FIELDS = tuple(f.name for f in dataclasses.fields(StepMetrics))


def step_metrics_from_dict(
    d: dict[str, Any] | None, *, step: int = 0, wall: float = 0.0, stall: float = 0.0
) -> StepMetrics:
    """A StepMetrics from ``StepMetrics.as_dict()`` output (extra keys ignored, missing ones defaulted
    from the step event's own figures)."""
    d = dict(d or {})
    base: dict[str, Any] = dict(
        step=step,
        wall_seconds=wall,
        compute_seconds=max(wall - stall, 0.0),
        stall_seconds=stall,
        cpu_optimizer_seconds=0.0,
        bytes_device_to_host=0,
        bytes_host_to_device=0,
        device_optimizer_state_bytes=0,
    )
    base.update({k: v for k, v in d.items() if k in _STEP_FIELDS and v is not None})
    return StepMetrics(**base)


def _multiprocess() -> bool:
    """Whether this process's metric values live in PROMETHEUS_MULTIPROC_DIR files (decided at import)."""
    return values.ValueClass is not values.MutexValue


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


def worker_telemetry() -> WorkerTelemetry:
    """This process's telemetry (global registry; worker name from settings, gpu detected)."""
    global _TELEMETRY
    with _TELEMETRY_LOCK:
        if _TELEMETRY is None:
            _TELEMETRY = WorkerTelemetry(default_worker_name(), detect_gpu())
        return _TELEMETRY


def model_label(model: str) -> str:
    """A bounded ``base_model`` label: a built-in name as is, a local checkpoint directory by its name."""
    m = str(model).rstrip("/")
    return Path(m).name if ("/" in m or os.sep in m) else m


class TrackedJob:
    """What :func:`track_job` yields: ``wrap(callback)`` tees every training event into the telemetry and
    remembers how the run ended (``run_finished`` -> succeeded/cancelled, ``error`` -> failed)."""

    def __init__(self, telemetry: WorkerTelemetry) -> None:
        self.telemetry = telemetry
        self.status: str | None = None

    def on_event(self, event: Any) -> None:
        etype = getattr(event, "type", None)
        if etype == "run_finished":
            self.status = "cancelled" if getattr(event, "cancelled", False) else "succeeded"
        elif etype == "error":
            self.status = "failed"
        self.telemetry.on_event(event)

    def wrap(self, callback: Any = None) -> Any:
        def on_event(event: Any) -> None:
            if callback is not None:
                callback(event)
            self.on_event(event)

        return on_event


@contextlib.contextmanager
def track_job(
    job_id: str, *, base_model: str, mode: str, telemetry: WorkerTelemetry | None = None
) -> Iterator[TrackedJob]:
    """Telemetry of one job run, for the job runner::

        with track_job(job.id, base_model=spec.model, mode=spec.engine.mode) as tj:
            result = run_training(spec, on_event=tj.wrap(reporter), should_cancel=...)

    ``zenflow_worker_current_job`` is 1 inside the block; on the way out the job is counted in
    ``zenflow_worker_jobs_total{status}`` (failed on an exception, ``interrupted`` when the run
    stopped without finishing, e.g. preempted). Telemetry problems never break the run.
    """
    tel = telemetry or worker_telemetry()
    tj = TrackedJob(tel)
    try:
        tel.job_started(job_id, base_model=base_model, mode=mode)
    except Exception:
        log.exception("telemetry: job_started failed")
    ok = False
    try:
        yield tj
        ok = True
    finally:
        status = tj.status or ("interrupted" if ok else "failed")
        try:
            tel.job_finished(status)
        except Exception:
            log.exception("telemetry: job_finished failed")


# --------------------------------------------------------------------------------------------------
# The serving side.


_AUTO: Any = object()


class HardwareCollector(Collector):
    """Readings taken at scrape time: NVML utilization and memory, and the worker's info series."""

    def __init__(
        self, worker: str, gpu: str, hostname: str, nvml: Nvml | None = None, nvml_index: int | None = _AUTO
    ) -> None:
        self.worker, self.gpu, self.hostname = worker, gpu, hostname
        self.nvml = nvml or NVML
        self._index = nvml_index
        self._uuid: str | None = None

    @property
    def index(self) -> int | None:
        if self._index is _AUTO:
            self._index = nvml_index(self.nvml)
        return self._index

    def collect(self) -> Iterator[Metric]:
        base = [self.worker, self.hostname, self.gpu]
        idx = self.index
        if idx is not None and self._uuid is None:
            self._uuid = self.nvml.uuid(idx) or ""
        info = GaugeMetricFamily(
            "zenflow_worker_info",
            "1 for every live worker; gpu_uuid joins DCGM's UUID label.",
            labels=[*BASE_LABELS, "gpu_uuid", "version"],
        )
        info.add_metric([*base, self._uuid or "", _version()], 1)
        yield info
        if idx is None:
            return
        s = self.nvml.sample(idx)
        if s is None:
            return
        util, used, total = s
        u = GaugeMetricFamily(
            "zenflow_nvml_gpu_utilization_ratio",
            "NVML utilization.gpu / 100: share of the sample period a kernel ran (DCGM_FI_DEV_GPU_UTIL / 100).",
            labels=list(BASE_LABELS),
        )
        u.add_metric(base, util)
        yield u
        m = GaugeMetricFamily(
            "zenflow_device_memory_bytes", "Device memory (NVML: used, total).", labels=[*BASE_LABELS, "kind"]
        )
        m.add_metric([*base, "used"], used)
        m.add_metric([*base, "total"], total)
        yield m


@functools.lru_cache(maxsize=1)
def _version() -> str:
    try:
        from importlib.metadata import version

        return version("zenflow")
    except Exception:
        return "unknown"


@contextlib.contextmanager
def _dir_lock(path: str, exclusive: bool) -> Iterator[None]:
    fd = os.open(os.path.join(path, ".lock"), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


class WorkerCollector(Collector):
    """Merges the multiprocess files, this process's own registry (when in-memory) and hardware readings
    into one exposition, one family per metric name."""

    def __init__(self, sources: Iterable[Any], multiproc_dir: str | None) -> None:
        self.sources = list(sources)
        self.multiproc_dir = multiproc_dir

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        order: list[str] = []

        def add(fam: Metric) -> None:
            have = families.get(fam.name)
            if have is None:
                families[fam.name] = fam
                order.append(fam.name)
            else:
                have.samples.extend(fam.samples)

        if self.multiproc_dir:
            with _dir_lock(self.multiproc_dir, exclusive=False):
                files = glob.glob(os.path.join(self.multiproc_dir, "*.db"))
                for fam in MultiProcessCollector.merge(files, accumulate=True):
                    add(fam)
        for src in self.sources:
            for fam in src.collect():
                add(fam)
        for name in order:
            yield families[name]


@dataclass
class WorkerMetricsServer:
    port: int
    multiproc_dir: str | None
    registry: CollectorRegistry
    _server: Any = None
    _thread: Any = None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


_SERVER: WorkerMetricsServer | None = None


def serve_worker_metrics(
    port: int | None = None,
    *,
    addr: str = "0.0.0.0",
    worker: str | None = None,
    gpu: str | None = None,
    multiproc_dir: str | os.PathLike[str] | None = None,
    nvml: Nvml | None = None,
) -> WorkerMetricsServer | None:
    """Serve this worker's metrics on ``port`` (default ``ZENFLOW_WORKER_METRICS_PORT``; 0 disables).

    Call once in the long-lived worker process before any job subprocess is spawned: it points
    ``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory (kept if already set, its stale files wiped),
    so the job subprocesses it spawns inherit it. Safe to call twice (returns the running server).
    """
    global _SERVER
    from prometheus_client import start_http_server

    from store.settings import get_settings

    settings = get_settings()
    port = settings.worker_metrics_port if port is None else port
    if not port:
        return None
    if _SERVER is not None:
        return _SERVER
    worker = worker or default_worker_name()
    gpu = gpu or detect_gpu(nvml)
    mp = multiproc_dir or os.environ.get(MULTIPROC_ENV)
    if not mp:
        mp = str(settings.data_dir.resolve() / "prometheus" / f"{_safe(worker)}-{port}")
    mp = str(mp)
    Path(mp).mkdir(parents=True, exist_ok=True)
    with _dir_lock(mp, exclusive=True):
        for f in glob.glob(os.path.join(mp, "*.db")):  # the previous run's samples (prometheus-client docs)
            os.remove(f)
    sources: list[Any] = [HardwareCollector(worker, gpu, _hostname(), nvml)]
    if not _multiprocess():
        # This process keeps its own metrics in memory (prometheus_client was imported before the
        # variable was set): serve them too, e.g. a job trained in this very process, and process_*.
        sources.append(REGISTRY)
    else:
        sources.append(ProcessCollector(registry=None))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(sources, mp))
    try:
        server, thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as e:  # e.g. two workers on one host given the same port: run on, without metrics
        log.error(
            "worker metrics: cannot listen on %s:%s (%s); give each worker its own "
            "ZENFLOW_WORKER_METRICS_PORT",
            addr,
            port,
            e,
        )
        return None
    os.environ[MULTIPROC_ENV] = mp  # inherited by every job subprocess spawned from now on
    _SERVER = WorkerMetricsServer(
        port=port, multiproc_dir=mp, registry=registry, _server=server, _thread=thread
    )
    log.info("worker metrics on %s:%s (multiprocess dir %s)", addr, port, mp)
    return _SERVER


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "worker"


def job_process_exited(pid: int, multiproc_dir: str | None = None) -> None:
    """A job subprocess ended (any way, SIGKILL included): drop its live gauges (current job, loss,
    utilization, memory) and fold its counters and histograms into the archive files, so the
    directory does not grow by one file set per job. No-op outside multiprocess mode."""
    mp = multiproc_dir or os.environ.get(MULTIPROC_ENV)
    if not mp or not os.path.isdir(mp):
        return
    with _dir_lock(mp, exclusive=True):
        mark_process_dead(pid, mp)
        # Gauges of other (non-live) modes of a dead pid are left alone: we define none.
        for typ in ("counter", "histogram", "summary"):
            f = os.path.join(mp, f"{typ}_{pid}.db")
            if os.path.exists(f):
                _fold_into_archive(f, os.path.join(mp, f"{typ}_archive.db"))


def _fold_into_archive(src: str, archive: str) -> None:
    vals = MmapedDict.read_all_values_from_file(src)
    d = MmapedDict(archive)
    try:
        for key, value, ts, _pos in vals:
            old, _ = d.read_value(key)
            d.write_value(key, old + value, ts)
    finally:
        d.close()
    os.remove(src)

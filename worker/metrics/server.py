"""A worker's /metrics: the job processes' multiprocess files merged with NVML readings.

The long-lived Celery worker process calls :func:`serve_worker_metrics` once before any job
subprocess is spawned (port ``ZENFLOW_WORKER_METRICS_PORT``): it points ``PROMETHEUS_MULTIPROC_DIR``
at a fresh directory, so every job process it spawns writes its samples there, and merges them at
scrape time together with NVML readings taken then (the serving process never touches CUDA). When a
job process exits, :func:`job_process_exited` drops its live gauges and folds its counters into the
archive files.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import REGISTRY, Collector

from worker.metrics.multiprocess import MULTIPROC_ENV, dir_lock, multiprocess_mode
from worker.metrics.nvml import NVML, Nvml, detect_gpu, nvml_index, visible_indices
from worker.metrics.telemetry import BASE_LABELS, default_worker_name, this_host

log = logging.getLogger(__name__)


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


def hardware_collectors(
    worker: str, gpu: str | None, hostname: str, nvml: Nvml | None = None
) -> list[HardwareCollector]:
    """The worker's NVML readings: one collector for its GPU (``gpu``, default detected), or one per
    GPU of a multi-GPU worker (``--gpus-per-job``: its ``CUDA_VISIBLE_DEVICES`` group, each labelled
    with its index, the ``gpu`` label its job's ranks report under)."""
    if gpu is None and len(group := visible_indices(nvml)) > 1:
        return [HardwareCollector(worker, str(i), hostname, nvml, nvml_index=i) for i in group]
    return [HardwareCollector(worker, gpu or detect_gpu(nvml), hostname, nvml)]


@functools.lru_cache(maxsize=1)
def _version() -> str:
    try:
        from importlib.metadata import version

        return version("zenflow")
    except Exception:
        return "unknown"


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
            with dir_lock(self.multiproc_dir, exclusive=False):
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
    mp = multiproc_dir or os.environ.get(MULTIPROC_ENV)
    if not mp:
        mp = str(settings.data_dir.resolve() / "prometheus" / f"{_safe(worker)}-{port}")
    mp = str(mp)
    Path(mp).mkdir(parents=True, exist_ok=True)
    with dir_lock(mp, exclusive=True):
        for f in glob.glob(os.path.join(mp, "*.db")):  # the previous run's samples (prometheus-client docs)
            os.remove(f)
    sources: list[Any] = list(hardware_collectors(worker, gpu, this_host(), nvml))
    if not multiprocess_mode():
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
    with dir_lock(mp, exclusive=True):
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

"""``python -m worker``: one Celery worker process per GPU (or one CPU worker).

Each process gets ``CUDA_VISIBLE_DEVICES`` of its GPU, consumes the queue named after its GPU kind
(``gpu-h100``) and the default queue, and serves its /metrics on the base port + its position.

``--gpus-per-job N`` (N > 1): the GPUs are cut into groups of N (8 GPUs: 4 workers of 2; leftovers
unused), each worker process gets its group's ``CUDA_VISIBLE_DEVICES`` and runs each job as N ranks
(``ZENFLOW_GPUS_PER_JOB``), consuming the queues of N-rank jobs (``<queue>-xN``,
:func:`worker.broker.queue_for_gpus`). Without enough GPUs it refuses to start, unless
``ZENFLOW_CPU_RANKS`` lets a worker without GPUs (``--gpus none``) run the N ranks on the CPU.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from typing import Any

from store.settings import Settings, get_settings
from worker import targets
from worker.broker import celery_app, queue_for_gpu_kind, queue_for_gpus
from worker.metrics.nvml import detect_gpus


def worker_argv(queues: list[str], nodename: str, loglevel: str) -> list[str]:
    """Arguments of ``celery worker`` for one GPU worker: solo pool, one job at a time."""
    return [
        "worker",
        "--pool",
        "solo",
        "--concurrency",
        "1",
        "-Q",
        ",".join(queues),
        "-n",
        nodename,
        "--loglevel",
        loglevel,
        "--without-gossip",
        "--without-mingle",
    ]


Gpu = tuple[int | None, str | None]


def gpu_groups(gpus: list[Gpu], per_job: int, *, cpu_ranks: bool) -> list[list[Gpu]]:
    """One worker per group of ``per_job`` GPUs (leftovers unused); a CPU worker ([(None, None)]) stays
    one group when ``cpu_ranks`` lets it run CPU ranks. Raises ValueError when it cannot run a job
    of ``per_job`` ranks."""
    if per_job < 1:
        raise ValueError(f"--gpus-per-job must be at least 1, not {per_job}")
    cpu = gpus == [(None, None)]
    if per_job == 1:
        return [[g] for g in gpus]
    if cpu or len(gpus) < per_job:
        if cpu_ranks:
            return [[(None, None)]]
        have = "no GPU" if cpu else f"{len(gpus)} GPU{'s' if len(gpus) > 1 else ''}"
        raise ValueError(
            f"--gpus-per-job {per_job}: this worker has {have}; give it {per_job} GPUs "
            f"(--gpus) or set ZENFLOW_CPU_RANKS=true to run the ranks on the CPU (gloo)"
        )
    return [gpus[i : i + per_job] for i in range(0, len(gpus) - len(gpus) % per_job, per_job)]


def _node(group: list[Gpu]) -> str:
    idx = [i for i, _ in group if i is not None]
    host = get_settings().worker_name or socket.gethostname()  # two workers on one machine: two names
    if not idx:
        return f"cpu@{host}"
    return f"gpu{idx[0]}@{host}" if len(idx) == 1 else f"gpus{'-'.join(map(str, idx))}@{host}"


def main(argv: list[str] | None = None) -> int:
    """``python -m worker``: one Celery worker per GPU (or one CPU worker)."""
    p = _parser()
    args = p.parse_args(argv)
    settings = get_settings()
    per_job = args.gpus_per_job or settings.gpus_per_job
    gpus = _chosen_gpus(args.gpus, dict(detect_gpus()))
    try:
        groups = gpu_groups(gpus, per_job, cpu_ranks=settings.cpu_ranks)
    except ValueError as e:
        p.error(str(e))
    if per_job > 1 and sum(len(g) for g in groups) < len(gpus) and groups[0][0][0] is not None:
        print(
            f"python -m worker: {len(gpus) % per_job} GPU(s) left unused by groups of {per_job}",
            file=sys.stderr,
        )
    # Our indices are NVML's (and nvidia-smi's), which count in PCI bus order; CUDA's default order is
    # fastest first, so without this CUDA_VISIBLE_DEVICES=1 could be another GPU on a mixed host.
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ["ZENFLOW_GPUS_PER_JOB"] = str(per_job)
    scrape_file = targets.publish(len(groups))  # Prometheus finds this host's workers (worker.targets)
    try:
        if len(groups) == 1:
            return _work_here(groups[0], per_job, args, settings)
        return _spawn_workers(groups, per_job, args, settings)
    finally:
        targets.remove_targets(scrape_file)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m worker", description=main.__doc__)
    p.add_argument("--gpus", default="auto", help="'auto', 'none' (one CPU worker) or indices like 0,1")
    p.add_argument(
        "--queues",
        default=None,
        help="comma-separated queues (default: gpu-<kind> of each GPU plus the default queue); "
        "with --gpus-per-job N > 1 each names the base of the queue consumed, <queue>-xN",
    )
    p.add_argument(
        "--gpus-per-job",
        type=int,
        default=None,
        help="ranks (GPUs) of each job a worker runs (default: ZENFLOW_GPUS_PER_JOB, 1): the "
        "GPUs are cut into groups of this size, one worker each",
    )
    p.add_argument("--loglevel", default="INFO")
    return p


def _chosen_gpus(arg: str, found: dict[int, str]) -> list[Gpu]:
    """The GPUs ``--gpus`` names among those ``found`` (index -> kind): [(None, None)] for a CPU worker."""
    if arg == "none" or (arg == "auto" and not found):
        return [(None, None)]
    if arg == "auto":
        return list(found.items())
    return [(int(i), found.get(int(i))) for i in arg.split(",")]


def _queues(queues: str | None, kind: str | None, per_job: int, default_queue: str) -> list[str]:
    """The queues a worker of ``kind`` GPUs consumes (``--queues``, else its kind's and the default)."""
    bases = list(queues.split(",")) if queues else [queue_for_gpu_kind(kind), default_queue]
    if per_job > 1:
        bases = [queue_for_gpus(per_job, q) for q in bases]
    return list(dict.fromkeys(bases))


def _devices(group: list[Gpu]) -> str:
    return ",".join(str(i) for i, _ in group if i is not None)


def _work_here(group: list[Gpu], per_job: int, args: argparse.Namespace, settings: Settings) -> int:
    """One group: this process becomes its Celery worker."""
    if group[0][0] is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = _devices(group)
    elif per_job > 1:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks (cpu_ranks)
    get_settings.cache_clear()  # gpus_per_job as set above
    from worker import hooks, task  # noqa: F401  (register the task and the hooks here)

    queues = _queues(args.queues, group[0][1], per_job, settings.default_queue)
    celery_app.worker_main(worker_argv(queues, _node(group), args.loglevel))
    return 0


def _spawn_workers(
    groups: list[list[Gpu]], per_job: int, args: argparse.Namespace, settings: Settings
) -> int:
    """Several groups: one ``celery worker`` process each, signals forwarded; the worst exit code."""
    procs = []
    for n, group in enumerate(groups):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": _devices(group)}
        if settings.worker_metrics_port:
            # One /metrics port per worker process: base port + position in the launch order.
            env["ZENFLOW_WORKER_METRICS_PORT"] = str(settings.worker_metrics_port + n)
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "worker",
            *worker_argv(
                _queues(args.queues, group[0][1], per_job, settings.default_queue),
                _node(group),
                args.loglevel,
            ),
        ]
        procs.append(subprocess.Popen(cmd, env=env))

    def forward(sig: int, _frame: Any) -> None:
        for pr in procs:
            if pr.poll() is None:
                pr.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return max(pr.wait() for pr in procs)

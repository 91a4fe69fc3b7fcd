"""``python -m trainer.worker``: one Celery worker process per GPU (or one CPU worker).

Each process gets ``CUDA_VISIBLE_DEVICES`` of its GPU, consumes the queue named after its GPU kind
(``gpu-h100``) and the default queue, and serves its /metrics on the base port + its position.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from typing import Any

from store.settings import get_settings
from trainer.worker.broker import celery_app, queue_for_gpu_kind
from trainer.worker.nvml import detect_gpus


def worker_argv(queues: list[str], nodename: str, loglevel: str) -> list[str]:
    """Arguments of ``celery worker`` for one GPU worker: solo pool, one job at a time."""
    return ["worker", "--pool", "solo", "--concurrency", "1", "-Q", ",".join(queues), "-n", nodename,
            "--loglevel", loglevel, "--without-gossip", "--without-mingle"]


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer.worker``: one Celery worker per GPU (or one CPU worker)."""
    p = argparse.ArgumentParser(prog="python -m trainer.worker", description=main.__doc__)
    p.add_argument("--gpus", default="auto", help="'auto', 'none' (one CPU worker) or indices like 0,1")
    p.add_argument("--queues", default=None,
                   help="comma-separated queues (default: gpu-<kind> of each GPU plus the default queue)")
    p.add_argument("--loglevel", default="INFO")
    args = p.parse_args(argv)
    settings = get_settings()
    found = dict(detect_gpus())
    if args.gpus == "none" or (args.gpus == "auto" and not found):
        gpus: list[tuple[int | None, str | None]] = [(None, None)]
    elif args.gpus == "auto":
        gpus = list(found.items())
    else:
        gpus = [(int(i), found.get(int(i))) for i in args.gpus.split(",")]

    def queues_for(kind: str | None) -> list[str]:
        if args.queues:
            return list(args.queues.split(","))
        return list(dict.fromkeys([queue_for_gpu_kind(kind), settings.default_queue]))

    # Our indices are NVML's (and nvidia-smi's), which count in PCI bus order; CUDA's default order is
    # fastest first, so without this CUDA_VISIBLE_DEVICES=1 could be another GPU on a mixed host.
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if len(gpus) == 1:
        idx, kind = gpus[0]
        if idx is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(idx)
        node = f"gpu{idx}@{socket.gethostname()}" if idx is not None else f"cpu@{socket.gethostname()}"
        from trainer.worker import hooks, task  # noqa: F401  (register the task and the hooks here)

        celery_app.worker_main(worker_argv(queues_for(kind), node, args.loglevel))
        return 0
    procs = []
    for n, (idx, kind) in enumerate(gpus):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(idx)}
        if settings.worker_metrics_port:
            # One /metrics port per worker process: base port + position in the launch order.
            env["ZENFLOW_WORKER_METRICS_PORT"] = str(settings.worker_metrics_port + n)
        cmd = [sys.executable, "-m", "celery", "-A", "trainer.worker",
               *worker_argv(queues_for(kind), f"gpu{idx}@{socket.gethostname()}", args.loglevel)]
        procs.append(subprocess.Popen(cmd, env=env))

    def forward(sig: int, _frame: Any) -> None:
        for pr in procs:
            if pr.poll() is None:
                pr.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return max(pr.wait() for pr in procs)

"""A host's worker /metrics endpoints as a Prometheus file_sd file, and the check that they answer.

``python -m worker`` starts one Celery worker per GPU (or GPU group), the i-th serving /metrics on
``ZENFLOW_WORKER_METRICS_PORT`` + i: how many depends on the host. With ``ZENFLOW_WORKER_TARGETS_DIR``
set, the launcher writes ``workers-<address>.json`` there, one target per worker process
(``<address>:<port>``, the address ``ZENFLOW_WORKER_ADDRESS`` or the host's name), and removes it when
it stops; Prometheus reads every such file (``file_sd_configs``, re-read on change: no reload, no
target written by hand). A worker killed without its stop leaves its file: its targets then show down
(``ZenflowWorkerDown``) until it starts again and writes the same file anew.

``python -m worker.targets --check``: the container healthcheck, every endpoint this host's file
lists answers on 127.0.0.1 (exit 0), else exit 1 naming the first that does not.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import urllib.request
from pathlib import Path

from store.settings import get_settings


def target_address() -> str:
    """The address Prometheus reaches this host's workers at."""
    return get_settings().worker_address or socket.gethostname()


def targets_file(directory: Path, address: str) -> Path:
    return directory / f"workers-{re.sub(r'[^A-Za-z0-9_.-]', '_', address)}.json"


def metrics_ports(base: int, count: int) -> list[int]:
    """The ports of ``count`` worker processes: ``base`` + their position (the launcher's rule)."""
    return [base + n for n in range(count)] if base else []


def write_targets(directory: Path, address: str, ports: list[int]) -> Path:
    """This host's targets written whole (a temporary file renamed over the old one): Prometheus never
    reads half a file."""
    directory.mkdir(parents=True, exist_ok=True)
    path = targets_file(directory, address)
    body = [{"targets": [f"{address}:{p}" for p in ports], "labels": {"zenflow_host": address}}]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    tmp.replace(path)
    return path


def remove_targets(path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)


def publish(count: int) -> Path | None:
    """Write the file for ``count`` worker processes when ``ZENFLOW_WORKER_TARGETS_DIR`` and a metrics
    port are set; its path (for :func:`remove_targets`) or None."""
    settings = get_settings()
    ports = metrics_ports(settings.worker_metrics_port, count)
    if not settings.worker_targets_dir or not ports:
        return None
    return write_targets(Path(settings.worker_targets_dir), target_address(), ports)


def check(directory: Path, address: str, timeout: float = 5.0) -> str | None:
    """None when every endpoint of this host's file answers /metrics on 127.0.0.1, else what failed."""
    path = targets_file(directory, address)
    try:
        groups = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"{path}: {e}"
    for target in (t for g in groups for t in g["targets"]):
        port = target.rsplit(":", 1)[1]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
                r.read(1)
        except OSError as e:
            return f"{target}: {e}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.targets", description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="every worker of this host answers /metrics")
    args = p.parse_args(argv)
    directory = get_settings().worker_targets_dir
    if not args.check or not directory:
        p.error("--check needs ZENFLOW_WORKER_TARGETS_DIR")
    problem = check(Path(directory), target_address())
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

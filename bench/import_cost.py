"""What a process pays to import what a job's rank imports, with and without Python's bytecode cache.

    python -m bench.import_cost              # 3 fresh interpreters each way
    python -m bench.import_cost --runs 5 --json

Every rank, worker, process template and test process starts by importing torch, transformers and the
trainer (:data:`worker.rank_template.PRELOAD`). Python reads that code from its bytecode cache
(``__pycache__``) when it may write one; with ``PYTHONDONTWRITEBYTECODE`` set and nothing compiled at
install (pip ``--no-compile``, as scripts/bootstrap.sh installs), it compiles every module from source
in every process. Measured here in fresh interpreters against a private cache folder
(``PYTHONPYCACHEPREFIX``): ``source`` (the folder empty, writing refused: the compile every time),
``cached`` (the folder filled by one run before). Printed: CPU and wall seconds per import (median)
and ``cpu_ratio`` (source over cached).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from worker.rank_template import PRELOAD


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _import_once(modules: tuple[str, ...], cache: str, write: bool) -> tuple[float, float]:
    """(CPU s, wall s) of one fresh interpreter importing ``modules``."""
    env = {**os.environ, "PYTHONPYCACHEPREFIX": cache}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if not write:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    cpu0, t0 = _children_cpu(), time.perf_counter()
    subprocess.run([sys.executable, "-c", code, *modules], env=env, check=True)
    return _children_cpu() - cpu0, time.perf_counter() - t0


@dataclass(frozen=True)
class ImportCost:
    modules: list[str]
    runs: int
    source_cpu_s: float
    source_wall_s: float
    cached_cpu_s: float
    cached_wall_s: float

    @property
    def cpu_ratio(self) -> float:
        return round(self.source_cpu_s / self.cached_cpu_s, 2) if self.cached_cpu_s else float("nan")


def _median(got: list[tuple[float, float]], i: int) -> float:
    return round(statistics.median(g[i] for g in got), 2)


def measure(runs: int, modules: tuple[str, ...] = PRELOAD) -> ImportCost:
    with tempfile.TemporaryDirectory(prefix="zf-pyc-") as empty, tempfile.TemporaryDirectory() as filled:
        source = [_import_once(modules, empty, write=False) for _ in range(runs)]
        _import_once(modules, filled, write=True)  # fills the cache
        cached = [_import_once(modules, filled, write=False) for _ in range(runs)]
    return ImportCost(
        list(modules), runs, _median(source, 0), _median(source, 1), _median(cached, 0), _median(cached, 1)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--modules", nargs="+", default=list(PRELOAD), help="what to import (default: a rank's)")
    args = p.parse_args(argv)
    r = measure(args.runs, tuple(args.modules))
    if args.json:
        print(json.dumps({**asdict(r), "cpu_ratio": r.cpu_ratio}))
        return 0
    print(f"importing {', '.join(r.modules)} in a fresh interpreter ({r.runs} runs each, median):")
    print(f"  compiled from source  {r.source_cpu_s:>6} CPU-s  {r.source_wall_s:>6} s wall")
    print(f"  from the cache        {r.cached_cpu_s:>6} CPU-s  {r.cached_wall_s:>6} s wall")
    print(f"  cpu_ratio {r.cpu_ratio}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

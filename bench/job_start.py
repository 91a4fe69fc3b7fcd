"""Job start benchmark: a node's ranks started as new interpreters against ranks forked from the process
template (:mod:`trainer.run.template`), the same launch otherwise, in one process.

    python -m bench.job_start                 # 3 jobs of 2 CPU ranks each way
    python -m bench.job_start --jobs 5 --nproc 2 --json

Each job is what a worker's job is up to its first step: :class:`trainer.run.launch.NodeRanks` starts
torch's elastic agent and ``--nproc`` ranks, and each rank imports what ``python -m worker.job.runner``
has imported before it trains (:data:`worker.rank_template.PRELOAD`), then exits. Run once with every
rank and agent exec'ing a new interpreter (``exec``), once on a template started in the same
environment (``template``; each rank checks that it was forked from it, else the run fails).

Printed per way: the wall seconds from the launch to the group's end (median over ``--jobs``) and the
CPU seconds per job (this process's reaped children: agents, ranks and stand-ins; for ``template`` the
template's own preload, measured by starting and closing one alone, is reported apart as
``template_preload_cpu_s`` and taken out of the per-job figure); then ``wall_ratio`` and
``cpu_ratio`` (exec over template). The template's preload is paid once per worker, at its first job.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping

from trainer.run.launch import NodeRanks
from trainer.run.template import TEMPLATE_ENV, ProcessTemplate
from worker.rank_template import PRELOAD

RANK_IMPORTS = tuple(m for m in PRELOAD if m != "trainer.run.agent")
NOT_FORKED = 3  # a rank's exit code when the template should have forked it and did not


def rank_main() -> int:
    """A rank: import what the job runner has imported before its first step, then say how it ran."""
    for module in RANK_IMPORTS:
        importlib.import_module(module)
    template = os.environ.get("ZENFLOW_BENCH_TEMPLATE_PID")
    return NOT_FORKED if template and os.getppid() != int(template) else 0


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_job(env: Mapping[str, str], nproc: int, run_id: str, timeout: float) -> float:
    """One job's ranks from launch to end; its wall seconds."""
    start = time.perf_counter()
    with NodeRanks(
        [sys.executable, "-m", "bench.job_start", "--as-rank"],
        nproc_per_node=nproc,
        run_id=run_id,
        devices=None,
        env=env,
        stdout=subprocess.DEVNULL,
    ) as ranks:
        end = ranks.start().wait(timeout)
    if end.code != 0:
        raise SystemExit(f"{run_id}: the ranks ended {end} (code {NOT_FORKED}: a rank was not forked)")
    return time.perf_counter() - start


def run_jobs(env: Mapping[str, str], args: argparse.Namespace, way: str) -> float:
    """``--jobs`` jobs one after another; the median wall seconds of one."""
    return statistics.median(run_job(env, args.nproc, f"{way}-{i}", args.timeout) for i in range(args.jobs))


def start_template(env: Mapping[str, str], timeout: float) -> ProcessTemplate:
    template = ProcessTemplate(PRELOAD).start(env)
    if not template.ready(timeout):
        template.close()
        raise SystemExit("the process template did not become ready")
    return template


def measure(args: argparse.Namespace) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != TEMPLATE_ENV}
    cpu0 = children_cpu()
    exec_way = {"wall_s": run_jobs(env, args, "exec"), "cpu_s": (children_cpu() - cpu0) / args.jobs}

    cpu0, t0 = children_cpu(), time.perf_counter()
    start_template(env, args.timeout).close()
    preload_cpu, preload_wall = children_cpu() - cpu0, time.perf_counter() - t0

    # A forked rank is the template's child: its CPU reaches this process when the template is reaped.
    cpu0 = children_cpu()
    template = start_template(env, args.timeout)
    assert template.proc is not None
    try:
        forked_env = {
            **env,
            TEMPLATE_ENV: template.path,
            "ZENFLOW_BENCH_TEMPLATE_PID": str(template.proc.pid),
        }
        forked_wall = run_jobs(forked_env, args, "template")
    finally:
        template.close()
    forked = {"wall_s": forked_wall, "cpu_s": (children_cpu() - cpu0 - preload_cpu) / args.jobs}
    return {
        "jobs": args.jobs,
        "nproc": args.nproc,
        "exec": exec_way,
        "template": forked,
        "template_preload_cpu_s": preload_cpu,
        "template_preload_wall_s": preload_wall,
        "wall_ratio": exec_way["wall_s"] / forked["wall_s"],
        "cpu_ratio": exec_way["cpu_s"] / max(forked["cpu_s"], 1e-3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=3, help="jobs each way (default 3)")
    ap.add_argument("--nproc", type=int, default=2, help="CPU ranks per job (default 2)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a job or the template may take")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.as_rank:
        return rank_main()
    res = measure(args)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{args.jobs} jobs of {args.nproc} CPU ranks, launch to end of the ranks' imports")
    for way in ("exec", "template"):
        r = res[way]
        assert isinstance(r, dict)
        print(f"  {way:8s}  wall {r['wall_s']:6.2f} s   cpu {r['cpu_s']:6.2f} s per job")
    print(
        f"  template preload (once per worker): wall {res['template_preload_wall_s']:.2f} s, "
        f"cpu {res['template_preload_cpu_s']:.2f} s"
    )
    print(f"  exec / template: wall {res['wall_ratio']:.1f}x, cpu {res['cpu_ratio']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

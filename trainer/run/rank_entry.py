"""One rank's wrapper: ``python -m trainer.run.rank_entry CMD...``, started by the elastic agent of
:mod:`trainer.run.agent` with the rank's ``env://`` variables, then replaced by ``CMD`` (exec: same pid),
or, where a process template serves ``CMD`` (:mod:`trainer.run.template`), its stand-in.

Before the exec it does what the agent does not: ties the rank to the agent (``PR_SET_PDEATHSIG``: a
killed agent takes its ranks with it, and a killed worker its agent), records the rank's pid for the
launcher (``RANK.pid`` in ``ZENFLOW_RANK_DIR``) and, for a CPU rank (``ZENFLOW_RANK_CPU_SHARE``),
pins it to its even share of the node's cores (by LOCAL_RANK of LOCAL_WORLD_SIZE) with
``OMP_NUM_THREADS`` at most that many. Imports no torch.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from trainer.run.launch import (
    AGENT_PID_ENV,
    CPU_SHARE_ENV,
    RANK_DIR_ENV,
    RUN_PID_SUFFIX,
    cpu_share,
)
from trainer.run.template import die_with_parent, run_forked


def prepare(env: dict[str, str]) -> None:
    """Apply the rank's CPU share (a CPU rank) to this process and ``env``."""
    if not env.get(CPU_SHARE_ENV) or not hasattr(os, "sched_setaffinity"):
        return
    share = cpu_share(int(env.get("LOCAL_RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", "1")))
    if not share:
        return
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, share)
    threads = len(share)
    with contextlib.suppress(ValueError):
        threads = min(threads, max(1, int(env.get("OMP_NUM_THREADS", threads))))
    env["OMP_NUM_THREADS"] = str(threads)


def main(argv: list[str] | None = None) -> int:
    cmd = sys.argv[1:] if argv is None else argv
    if not cmd:
        print("usage: python -m trainer.run.rank_entry CMD...", file=sys.stderr)
        return 2
    env = dict(os.environ)
    agent = env.get(AGENT_PID_ENV)
    if agent:
        die_with_parent(int(agent))
    rank_dir = env.get(RANK_DIR_ENV)
    rank = env.get("RANK", "0")
    if rank_dir:
        tmp = Path(rank_dir) / f".{rank}.tmp"
        tmp.write_text(str(os.getpid()))
        tmp.replace(Path(rank_dir) / f"{rank}.pid")
    prepare(env)
    sys.stdout.flush()
    run_forked(cmd, env, pid_file=str(Path(rank_dir) / f"{rank}.{RUN_PID_SUFFIX}") if rank_dir else None)
    os.execvpe(cmd[0], cmd, env)  # no process template serves this command
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())

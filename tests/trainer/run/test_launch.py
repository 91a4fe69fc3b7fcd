"""trainer.run.launch: a job's ranks under torch's elastic agent (tiny python children, no torch in
them): a failing rank takes the others down, its exit code is the group's, a signal reaches every rank,
CPU ranks get their share of the cores, and nothing outlives the agent or the process that started it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainer.run.launch import (
    EXIT_PEER_LOST,
    NodeRanks,
    RankExit,
    allowed_cpus,
    cpu_share,
    free_port,
)

ROOT = Path(__file__).resolve().parents[3]


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def child(code: str, *args: str) -> list[str]:
    """argv of a tiny python child; every child ends by itself within a minute whatever happens."""
    return [sys.executable, "-c", textwrap.dedent(code), *args]


#: Rank r: ``up-r`` once its SIGTERM handler is in place; on SIGTERM ``term-r`` and exit 75 (rank 0: a
#: preempted runner) or 0; rank 1 exits ``FAIL`` once every rank is up (when set); rank 2 ignores SIGTERM.
RANK = """
import os, signal, sys, time
from pathlib import Path
d = Path(sys.argv[1])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
def on_term(*_):
    (d / f"term-{rank}").write_text("x")
    sys.exit(75 if rank == 0 else 0)
stubborn = os.environ.get("STUBBORN") == "1" and rank == 2
signal.signal(signal.SIGTERM, signal.SIG_IGN if stubborn else on_term)
(d / f"up-{rank}").write_text(str(os.getpid()))
if rank == 1 and os.environ.get("FAIL"):
    while not all((d / f"up-{r}").exists() for r in range(world)): time.sleep(0.01)
    sys.exit(int(os.environ["FAIL"]))
time.sleep(60)
sys.exit(7)
"""


def ranks(cmd: list[str], n: int, **env: str) -> NodeRanks:
    base = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return NodeRanks(
        cmd, nproc_per_node=n, run_id=f"test-{os.getpid()}", devices=None, env=base, term_grace=2
    )


def all_up(d: Path, n: int) -> None:
    wait_until(lambda: all((d / f"up-{r}").exists() for r in range(n)), 60, "the ranks to start")


# --- CPU shares ----------------------------------------------------------------------------------


def test_cpu_share_is_an_even_disjoint_split() -> None:
    assert [cpu_share(r, 3, range(8)) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [cpu_share(r, 4, [0, 1]) for r in range(4)] == [[0], [1], [0], [1]]  # more ranks than cores
    shares = [cpu_share(r, 2) for r in range(2)]
    assert sorted(c for s in shares for c in s) == allowed_cpus() and all(shares)
    assert 0 < free_port() < 65536


def test_a_launch_needs_a_layout_it_can_run() -> None:
    with pytest.raises(ValueError, match="need 3 GPUs"):
        NodeRanks(["true"], nproc_per_node=3, run_id="x", devices=["0"], env={})
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        NodeRanks(["true"], nproc_per_node=1, nnodes=2, run_id="x", devices=None, env={})
    with pytest.raises(ValueError):
        NodeRanks([], nproc_per_node=1, run_id="x", devices=None, env={})


@pytest.mark.services  # agent processes
def test_cpu_ranks_get_their_share_of_the_cores_and_the_env_vars(tmp_path: Path) -> None:
    report = """
    import json, os, sys
    from pathlib import Path
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TORCHELASTIC_RUN_ID")
    out = {k: os.environ.get(k) for k in keys}
    out["cpus"] = sorted(os.sched_getaffinity(0))
    (Path(sys.argv[1]) / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(out))
    """
    with ranks(child(report, str(tmp_path)), 2, OMP_NUM_THREADS="64") as g:
        assert g.start().wait(60) == RankExit(0)
    seen = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [(s["RANK"], s["LOCAL_RANK"], s["WORLD_SIZE"], s["GROUP_RANK"]) for s in seen] == [
        ("0", "0", "2", "0"),
        ("1", "1", "2", "0"),
    ]
    assert len({s["MASTER_PORT"] for s in seen}) == 1 and {s["TORCHELASTIC_RUN_ID"] for s in seen} == {
        f"test-{os.getpid()}"
    }
    assert [s["cpus"] for s in seen] == [cpu_share(r, 2) for r in range(2)]
    assert [int(s["OMP_NUM_THREADS"]) for s in seen] == [len(s["cpus"]) for s in seen]
    assert {s["CUDA_VISIBLE_DEVICES"] for s in seen} == {""}


@pytest.mark.services  # agent processes
def test_gpu_ranks_each_see_their_own_gpu(tmp_path: Path) -> None:
    report = """
    import json, os, sys
    from pathlib import Path
    out = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "ZENFLOW_RANK_CPU_SHARE")}
    (Path(sys.argv[1]) / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(out))
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with NodeRanks(
        child(report, str(tmp_path)), nproc_per_node=2, run_id="gpus", devices=["3", "5", "6"], env=env
    ) as node:
        end = node.start().wait()
    assert end == RankExit(0)
    seen = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [(s["RANK"], s["CUDA_VISIBLE_DEVICES"]) for s in seen] == [("0", "3"), ("1", "5")]
    assert all(s["LOCAL_RANK"] == "0" and s["ZENFLOW_RANK_CPU_SHARE"] is None for s in seen)


# --- failures and teardown -------------------------------------------------------------------------


@pytest.mark.services  # agent processes
def test_failing_rank_takes_the_group_down(tmp_path: Path) -> None:
    """Rank 1 exits 3: rank 0 gets SIGTERM (exits 75, as a preempted runner), rank 2 ignores it and is
    killed after torch's grace; the group's code is rank 1's and no rank is alive afterwards."""
    with ranks(child(RANK, str(tmp_path)), 3, FAIL="3", STUBBORN="1") as g:
        g.start()
        all_up(tmp_path, 3)  # the clock starts once rank 1 may fail: the agent's own start is not timed
        t0 = time.monotonic()
        assert g.wait(60) == RankExit(3, 1)
        # rank 2 sleeps 60 s: killed after the grace torch's process context gives when a rank fails
        # (its fixed 30 s, not term_grace), never awaited
        assert time.monotonic() - t0 < 50
        pids = g.pids
    assert len(pids) == 3 and (tmp_path / "term-0").exists()  # rank 0 was asked to stop first
    assert not any(alive(p) for p in pids)


def test_first_failure_is_the_first_seen_a_peer_lost_exit_last() -> None:
    """The agent's failures in the order it saw them; a rank 0 that lost its peer (76) in the same round
    as the peer's own failure is never the cause."""
    from types import SimpleNamespace as F

    from trainer.run.agent import first_failure

    assert first_failure({0: F(exitcode=EXIT_PEER_LOST), 1: F(exitcode=-signal.SIGKILL)}) == (1, -9)
    assert first_failure({2: F(exitcode=3), 1: F(exitcode=-signal.SIGTERM)}) == (2, 3)
    assert first_failure({0: F(exitcode=EXIT_PEER_LOST)}) == (0, EXIT_PEER_LOST)  # another node's rank failed


@pytest.mark.services  # agent processes
def test_rank_killed_by_a_signal_is_the_groups_code(tmp_path: Path) -> None:
    """A rank dying by SIGKILL (the OOM killer) gives the group -SIGKILL even though its peer fails
    right after it on the broken link (exit 76), as worker.requeue expects of a killed runner."""
    code = """
    import os, signal, sys, time
    from pathlib import Path
    d = Path(sys.argv[1])
    if os.environ["RANK"] == "1":
        while not (d / "up-0").exists(): time.sleep(0.01)
        (d / "peer").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    (d / "up-0").write_text("x")
    while not (d / "peer").exists(): time.sleep(0.01)
    pid = int((d / "peer").read_text())
    while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.001)
    sys.exit(int(sys.argv[2]))
    """
    with ranks(child(code, str(tmp_path), str(EXIT_PEER_LOST)), 2) as g:
        assert g.start().wait(60) == RankExit(-signal.SIGKILL, 1)


@pytest.mark.services  # agent processes
def test_terminate_reaches_every_rank_and_keeps_their_codes(tmp_path: Path) -> None:
    """A preemption: SIGTERM forwarded to the ranks themselves; they exit on their own, rank 0 with 75,
    which is the group's code (not the agent's teardown)."""
    with ranks(child(RANK, str(tmp_path)), 3) as g:
        g.start()
        all_up(tmp_path, 3)
        with pytest.raises(subprocess.TimeoutExpired):
            g.wait(0.3)
        g.terminate(signal.SIGTERM)
        assert g.wait(60) == RankExit(75, 0)
        pids = g.pids
    assert all((tmp_path / f"term-{r}").exists() for r in range(3))
    assert not any(alive(p) for p in pids)


@pytest.mark.services  # agent processes
def test_sigterm_to_the_agent_tears_down_every_rank(tmp_path: Path) -> None:
    with ranks(child(RANK, str(tmp_path)), 2) as g:
        g.start()
        all_up(tmp_path, 2)
        pids = g.pids
        assert len(pids) == 2 and g.agent_pid is not None
        os.kill(g.agent_pid, signal.SIGTERM)
        assert g.wait(60) == RankExit(-signal.SIGTERM)
    assert all((tmp_path / f"term-{r}").exists() for r in range(2))  # stopped by the agent, in order
    assert not any(alive(p) for p in pids)


@pytest.mark.services  # agent processes
def test_helpers_a_rank_started_go_with_the_group(tmp_path: Path) -> None:
    """A rank that dies leaves nothing behind: what it started in its process group is killed too."""
    code = """
    import os, subprocess, sys, time
    from pathlib import Path
    if os.environ["RANK"] == "1":
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        (Path(sys.argv[1]) / "helper").write_text(str(p.pid))
        sys.exit(3)
    time.sleep(60)
    """
    with ranks(child(code, str(tmp_path)), 2) as g:
        assert g.start().wait(60) == RankExit(3, 1)
    helper = int((tmp_path / "helper").read_text())
    wait_until(lambda: not alive(helper), 10, "the rank's helper to be killed")


@pytest.mark.services  # agent processes
def test_agent_and_ranks_die_with_the_process_that_started_them(tmp_path: Path) -> None:
    """The starting process (the worker) is SIGKILLed: the agent follows it and every rank the agent
    (PR_SET_PDEATHSIG at both steps)."""
    sup = f"""
    import os, sys, time
    sys.path.insert(0, {str(ROOT)!r})
    from trainer.run.launch import NodeRanks
    env = {{**os.environ, "PYTHONPATH": {str(ROOT)!r}}}
    g = NodeRanks([sys.executable, "-c", "import time; time.sleep(60)"], nproc_per_node=2, run_id="sup",
              devices=None, env=env).start()
    while len(g.pids) < 2: time.sleep(0.05)
    print(g.agent_pid, *g.pids, flush=True)
    g.wait(60)
    """
    p = subprocess.Popen(child(sup), stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 3 and all(alive(x) for x in pids)
        p.kill()
        p.wait(10)
        wait_until(lambda: not any(alive(x) for x in pids), 20, "the agent and ranks to die with it")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)

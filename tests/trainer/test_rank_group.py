"""trainer.run.launch: one rank's environment and the supervision of a job's ranks as one unit (tiny python
children, no torch): a failing rank takes the others down, its exit code is the group's, nothing
outlives the group or its supervisor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainer.run.launch import (
    RANK_CPUS_ENV,
    RankGroup,
    allowed_cpus,
    cpu_share,
    free_port,
    group_envs,
    rank_env,
)

ROOT = Path(__file__).resolve().parents[2]


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


SLEEPER = """
import os, signal, sys, time
from pathlib import Path
d = Path(sys.argv[1]) if len(sys.argv) > 1 else None
rank = os.environ["RANK"]
def on_term(*_):
    if d: (d / f"term-{rank}").write_text("x")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
if d: (d / f"up-{rank}").write_text(str(os.getpid()))
time.sleep(60)
sys.exit(7)
"""


def envs(world: int, **extra: str) -> list[dict[str, str]]:
    return group_envs(world, devices=None, base={**os.environ, **extra})


# --- environment ---------------------------------------------------------------------------------


def test_rank_env_gpu_and_cpu_ranks() -> None:
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2,5", "OMP_NUM_THREADS": "3"}
    g = [rank_env(r, 2, 29500, visible_device=d, base=base) for r, d in enumerate(["2", "5"])]
    assert [(e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in g] == [
        ("0", "2", "0", "2"),
        ("1", "2", "1", "5"),
    ]
    assert all(
        e["MASTER_ADDR"] == "127.0.0.1" and e["MASTER_PORT"] == "29500" and e["PATH"] == "/bin" for e in g
    )
    assert all(
        RANK_CPUS_ENV not in e and e["OMP_NUM_THREADS"] == "3" for e in g
    )  # the engine places GPU ranks
    assert base["CUDA_VISIBLE_DEVICES"] == "2,5"  # base untouched

    cpus = list(range(8))
    c = [
        rank_env(r, 2, 29500, visible_device=None, base={"OMP_NUM_THREADS": "16"}, cpus=cpus)
        for r in range(2)
    ]
    assert [(e[RANK_CPUS_ENV], e["OMP_NUM_THREADS"], e["CUDA_VISIBLE_DEVICES"]) for e in c] == [
        ("0,1,2,3", "4", ""),
        ("4,5,6,7", "4", ""),
    ]
    one = rank_env(1, 2, 1, visible_device=None, base={"OMP_NUM_THREADS": "1"}, cpus=cpus)
    assert one["OMP_NUM_THREADS"] == "1"  # never more threads than the caller allowed
    with pytest.raises(ValueError):
        rank_env(2, 2, 1, visible_device=None, base={})


def test_cpu_share_is_an_even_disjoint_split() -> None:
    assert [cpu_share(r, 3, range(8)) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [cpu_share(r, 4, [0, 1]) for r in range(4)] == [[0], [1], [0], [1]]  # more ranks than cores
    shares = [cpu_share(r, 2) for r in range(2)]
    assert sorted(c for s in shares for c in s) == allowed_cpus() and all(shares)


def test_group_envs_share_one_fresh_port() -> None:
    g = group_envs(3, devices=["0", "1", "2"], base={})
    assert len({e["MASTER_PORT"] for e in g}) == 1 and [e["CUDA_VISIBLE_DEVICES"] for e in g] == [
        "0",
        "1",
        "2",
    ]
    assert 0 < free_port() < 65536
    with pytest.raises(ValueError, match="need 3 GPUs"):
        group_envs(3, devices=["0"], base={})


# --- supervision -----------------------------------------------------------------------------------


def test_failing_rank_takes_the_group_down(tmp_path: Path) -> None:
    """Rank 1 exits 1: rank 0 gets SIGTERM (exits), rank 2 ignores it and is killed after the grace;
    the group's code is rank 1's and no child is alive afterwards."""
    stubborn = """
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)
    """
    argvs = [
        child(SLEEPER, str(tmp_path)),
        child("import time, sys; time.sleep(0.5); sys.exit(1)"),
        child(stubborn),
    ]
    g = RankGroup(argvs, envs(3), term_grace=1.0).start()
    t0 = time.monotonic()
    assert g.wait(timeout=30) == 1
    assert time.monotonic() - t0 < 20
    assert g.failed_rank == 1
    assert g.returncodes() == [0, 1, -signal.SIGKILL]
    assert (tmp_path / "term-0").exists()  # rank 0 was asked to stop first
    assert not any(alive(p) for p in g.pids)


def test_rank_killed_by_a_signal_is_the_groups_code(tmp_path: Path) -> None:
    """A rank dying by SIGKILL (the OOM killer) gives the group -SIGKILL even though its peer fails
    right after it (exit 5: the broken connection), as requeue.py expects of a killed runner."""
    argvs = [
        child(
            """
        import os, signal, sys, time
        from pathlib import Path
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        peer = Path(sys.argv[1]) / "peer"
        while not peer.exists(): time.sleep(0.01)
        pid = int(peer.read_text())
        while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.005)
        sys.exit(5)
        """,
            str(tmp_path),
        ),
        child(
            """
        import os, signal, sys
        from pathlib import Path
        (Path(sys.argv[1]) / "peer").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
        """,
            str(tmp_path),
        ),
    ]
    g = RankGroup(argvs, envs(2), term_grace=2.0).start()
    assert g.wait(timeout=30) == -signal.SIGKILL
    assert g.failed_rank == 1 and g.returncodes() == [5, -signal.SIGKILL]


def test_all_exit_on_their_own_rank_zero_decides(tmp_path: Path) -> None:
    ok = RankGroup([child("import sys; sys.exit(0)")] * 2, envs(2)).start()
    assert ok.wait(timeout=30) == 0 and ok.failed_rank is None
    # rank 1 done first, then rank 0 preempted (75): the job's code is rank 0's
    pre = RankGroup(
        [child("import sys, time; time.sleep(0.5); sys.exit(75)"), child("import sys; sys.exit(0)")], envs(2)
    ).start()
    assert pre.wait(timeout=30) == 75 and pre.failed_rank == 0


def test_stragglers_after_rank_zero_exited_are_stopped(tmp_path: Path) -> None:
    g = RankGroup(
        [child("import sys; sys.exit(0)"), child(SLEEPER, str(tmp_path))], envs(2), term_grace=0.5
    ).start()
    assert g.wait(timeout=30) == 0
    assert g.returncodes() == [0, 0] and (tmp_path / "term-1").exists()


def test_terminate_forwards_to_every_rank(tmp_path: Path) -> None:
    g = RankGroup([child(SLEEPER, str(tmp_path))] * 3, envs(3)).start()
    wait_until(lambda: all((tmp_path / f"up-{r}").exists() for r in range(3)), 30, "the ranks to start")
    with pytest.raises(subprocess.TimeoutExpired):
        g.wait(timeout=0.3)
    g.terminate(signal.SIGTERM)
    assert g.wait(timeout=30) == 0
    assert all((tmp_path / f"term-{r}").exists() for r in range(3))
    assert not any(alive(p) for p in g.pids)


def test_rank_env_reaches_the_child_with_its_cpu_share(tmp_path: Path) -> None:
    report = """
    import json, os, sys
    from pathlib import Path
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
    out = {k: os.environ.get(k) for k in keys}
    out["cpus"] = sorted(os.sched_getaffinity(0))
    (Path(sys.argv[1]) / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(out))
    """
    import json

    g = RankGroup([child(report, str(tmp_path))] * 2, envs(2, OMP_NUM_THREADS="64")).start()
    assert g.wait(timeout=30) == 0
    seen = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [s["RANK"] for s in seen] == ["0", "1"] and {s["WORLD_SIZE"] for s in seen} == {"2"}
    assert [s["LOCAL_RANK"] for s in seen] == ["0", "1"] and len({s["MASTER_PORT"] for s in seen}) == 1
    assert [s["cpus"] for s in seen] == [cpu_share(r, 2) for r in range(2)]
    assert [int(s["OMP_NUM_THREADS"]) for s in seen] == [len(s["cpus"]) for s in seen]
    assert {s["CUDA_VISIBLE_DEVICES"] for s in seen} == {""}


def test_helpers_a_rank_started_go_with_the_group(tmp_path: Path) -> None:
    """A rank that dies leaves nothing behind: what it started in its process group is killed too."""
    spawner = """
    import subprocess, sys, time
    from pathlib import Path
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (Path(sys.argv[1]) / "helper").write_text(str(p.pid))
    sys.exit(3)
    """
    g = RankGroup([child(SLEEPER), child(spawner, str(tmp_path))], envs(2), term_grace=1.0).start()
    assert g.wait(timeout=30) == 3
    helper = int((tmp_path / "helper").read_text())
    wait_until(lambda: not alive(helper), 10, "the rank's helper to be killed")


def test_ranks_die_with_their_supervisor(tmp_path: Path) -> None:
    """The supervising process is SIGKILLed: every rank follows it (PR_SET_PDEATHSIG)."""
    sup = f"""
    import os, sys
    sys.path.insert(0, {str(ROOT)!r})
    from trainer.run.launch import RankGroup, group_envs
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    g = RankGroup([argv] * 2, group_envs(2, devices=None, base=dict(os.environ))).start()
    print(" ".join(map(str, g.pids)), flush=True)
    g.wait(timeout=60)
    """
    p = subprocess.Popen(child(sup), stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(x) for x in pids)
        p.kill()
        p.wait(10)
        wait_until(lambda: not any(alive(x) for x in pids), 10, "the ranks to die with their supervisor")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_a_group_needs_one_env_per_rank() -> None:
    with pytest.raises(ValueError):
        RankGroup([child("pass")], [])

"""trainer.run.template: a rank forked from the process template runs as the process it stands in for
would have (its environment, working directory, output, affinity, exit code or signal), signals reach
it, it dies with its stand-in or its template, and where the template cannot serve the stand-in starts
a new interpreter instead; under the elastic agent (NodeRanks) the ranks' codes are the group's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import startup_seconds
from tests.trainer.run.test_launch import alive, wait_until
from trainer.run.launch import NodeRanks, RankExit
from trainer.run.template import TEMPLATE_ENV, ProcessTemplate, env_difference, import_env, module_of

ROOT = Path(__file__).resolve().parents[3]
TARGET = "tests.trainer.run.template_target"

#: A stand-in: runs its argv through the template named in its environment (or execs it), writing the
#: forked child's pid to ``$ZENFLOW_TEST_PID_FILE``.
STAND_IN = textwrap.dedent(
    """
    import os, sys
    from trainer.run.template import run_forked
    run_forked(sys.argv[1:], os.environ, pid_file=os.environ.get("ZENFLOW_TEST_PID_FILE"))
    print("exec", flush=True)
    os.execv(sys.argv[1], sys.argv[1:])
    """
)


#: The template's environment and its ranks' (but for what a test adds): taken once, as a worker's is.
BASE = {k: v for k, v in os.environ.items() if k != TEMPLATE_ENV} | {"PYTHONPATH": str(ROOT)}


def _env(**extra: str) -> dict[str, str]:
    return {**BASE, **extra}


@pytest.fixture
def template() -> Iterator[ProcessTemplate]:
    t = ProcessTemplate(["json", "torch"]).start(_env())
    try:
        assert t.ready(timeout=10 * startup_seconds()), "the template never became ready"
        yield t
    finally:
        t.close()


def stand_in(template: ProcessTemplate, *args: str, cwd: Path, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", STAND_IN, sys.executable, "-m", TARGET, *args],
        env=_env(**{TEMPLATE_ENV: template.path}, **env),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def report(proc: subprocess.Popen[str]) -> dict[str, object]:
    """The target's JSON line (read from the stand-in's stdout: the child writes to the stand-in's fd)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("{"), line + (proc.stderr.read() if proc.stderr else "")
    result: dict[str, object] = json.loads(line)
    return result


def test_only_python_dash_m_of_this_interpreter_is_forked() -> None:
    assert module_of([sys.executable, "-m", "worker.job.runner", "j"]) == ("worker.job.runner", ["j"])
    assert module_of([sys.executable, "-c", "pass"]) is None
    assert module_of(["/usr/bin/python3", "-m", "x"]) is None or sys.executable == "/usr/bin/python3"


def test_per_rank_variables_and_settings_may_differ_nothing_else() -> None:
    base = {"PATH": "/bin", "HOME": "/root"}
    rank = {**base, "RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "r", "ZENFLOW_DATA_DIR": "/d"}
    assert env_difference(import_env(base), import_env(rank)) is None
    assert env_difference(import_env(base), import_env({**base, "HF_HOME": "/h"})) == "HF_HOME"
    assert env_difference(import_env(base), import_env({"PATH": "/bin"})) == "HOME"


def test_a_forked_rank_runs_as_its_stand_in_would(template: ProcessTemplate, tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    proc = stand_in(
        template,
        "exit",
        "7",
        cwd=tmp_path,
        ZENFLOW_TEMPLATE_PROBE="probe",
        RANK="3",
        OMP_NUM_THREADS="1",
        ZENFLOW_TEST_PID_FILE=str(pid_file),
    )
    seen = report(proc)
    assert proc.wait(timeout=60) == 7
    assert template.proc is not None and seen["ppid"] == template.proc.pid  # forked, not exec'd
    assert seen["pid"] != proc.pid and int(pid_file.read_text()) == seen["pid"]
    assert seen["main"] == "__main__" and seen["argv"][1:] == ["exit", "7"]  # type: ignore[index]
    assert (seen["env"], seen["rank"], seen["cwd"]) == ("probe", "3", str(tmp_path))
    assert seen["torch_threads"] == 1  # from the rank's OMP_NUM_THREADS, not the template's


def test_signals_reach_the_child_and_its_end_is_the_stand_ins(
    template: ProcessTemplate, tmp_path: Path
) -> None:
    proc = stand_in(template, "term", cwd=tmp_path)
    child = int(report(proc)["pid"])  # type: ignore[call-overload]
    # torch's pool threads block the forwarded signals, so none can take the one meant for the main
    # thread (sleeping in a system call, it would not run the handler until the call ended)
    for tid in os.listdir(f"/proc/{child}/task"):
        if int(tid) != child:
            blocked = int(_status(Path(f"/proc/{child}/task/{tid}/status"))["SigBlk"], 16)
            assert blocked >> (signal.SIGTERM - 1) & 1, tid
    proc.send_signal(signal.SIGTERM)
    assert _wait_or_explain(proc, child, template) == 75  # the child's own handler ran and chose its code
    killed = stand_in(template, "kill", cwd=tmp_path)
    report(killed)
    assert killed.wait(timeout=60) == -signal.SIGKILL  # killed as the child was


def _wait_or_explain(proc: subprocess.Popen[str], child: int, template: ProcessTemplate) -> int | None:
    """``proc``'s exit code; past a minute, a failure that says where each of the three processes is
    (how the stolen signal, below, was found)."""
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        where = {
            name: _proc_state(pid)
            for name, pid in (
                ("stand-in", proc.pid),
                ("child", child),
                ("template", template.proc.pid if template.proc else -1),
            )
        }
        proc.kill()
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"the stand-in did not end 60 s after SIGTERM: {where}; its stderr: {err[-2000:]}")


def _status(path: Path) -> dict[str, str]:
    return {
        k: v.strip() for k, v in (ln.split(":\t", 1) for ln in path.read_text().splitlines() if ":\t" in ln)
    }


def _proc_state(pid: int) -> str:
    try:
        status = _status(Path(f"/proc/{pid}/status"))
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        stack = Path(f"/proc/{pid}/stack").read_text() if os.access(f"/proc/{pid}/stack", os.R_OK) else ""
    except OSError as e:
        return f"gone ({e.__class__.__name__})"
    fields = ("State", "SigPnd", "ShdPnd", "SigBlk", "SigCgt", "Threads")
    return f"{ {k: status.get(k, '') for k in fields} } wchan={wchan} {stack[-600:]}"


def test_a_child_dies_with_its_stand_in(template: ProcessTemplate, tmp_path: Path) -> None:
    proc = stand_in(template, "sleep", cwd=tmp_path)
    child = int(report(proc)["pid"])  # type: ignore[call-overload]
    proc.kill()  # the agent's SIGKILL: no handler runs
    proc.wait(timeout=60)
    wait_until(lambda: not alive(child), 30, "the orphaned child to be killed by the template")


def test_a_child_dies_with_its_template_and_the_next_rank_execs(
    template: ProcessTemplate, tmp_path: Path
) -> None:
    proc = stand_in(template, "sleep", cwd=tmp_path)
    child = int(report(proc)["pid"])  # type: ignore[call-overload]
    assert template.proc is not None
    template.proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    wait_until(lambda: not alive(child), 30, "the child to die with its template")
    template.proc.wait(timeout=60)
    after = stand_in(template, "exit", "0", cwd=tmp_path)
    out, _ = after.communicate(timeout=120)
    assert after.returncode == 0 and out.startswith("exec"), out  # no template: a new interpreter


def test_another_environment_starts_a_new_interpreter(template: ProcessTemplate, tmp_path: Path) -> None:
    proc = stand_in(template, "exit", "3", cwd=tmp_path, HF_HOME=str(tmp_path))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3 and out.startswith("exec"), out
    assert "differs from the template's in HF_HOME" in err


def test_ranks_under_the_agent_fork_from_the_template(template: ProcessTemplate, tmp_path: Path) -> None:
    """Two ranks whose command exits 4 once both have reported: the group's code is 4; the agent and both ranks ran forked (the
    ranks' run pids are the template's children, beside the ranks the agent started; the agent's pid is
    not its stand-in's, which an exec would have kept)."""
    out, gathered = tmp_path / "out.txt", tmp_path / "gathered"
    gathered.mkdir()
    with (
        out.open("w") as log,
        NodeRanks(
            [sys.executable, "-m", TARGET, "gather", str(gathered), "4"],
            nproc_per_node=2,
            run_id="template",
            devices=None,
            env=_env(**{TEMPLATE_ENV: template.path}),
            stdout=log,
            stderr=subprocess.STDOUT,
        ) as g,
    ):
        g.start()
        end = g.wait(timeout=60 + 4 * startup_seconds())
        assert isinstance(end, RankExit) and end.code == 4 and end.rank in (0, 1), out.read_text()
        run_pids, rank_pids, stand_in_pid = g.run_pids, g.pids, g.agent_pid
    seen = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    assert template.proc is not None
    assert sorted(s["rank"] for s in seen) == ["0", "1"]
    assert all(s["ppid"] == template.proc.pid for s in seen), seen
    assert sorted(run_pids) == sorted(s["pid"] for s in seen) and not set(run_pids) & set(rank_pids)
    assert {s["agent"] for s in seen} != {str(stand_in_pid)} and len({s["agent"] for s in seen}) == 1

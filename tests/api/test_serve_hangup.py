"""Closing the terminal stops ``zenflow serve`` (issue 39): the terminal's process group gets SIGHUP, and
the server, its embedded worker's job processes (the process template and the ranks, each in a group of
its own) and its helpers all exit, the running job checkpointed and re-queued; the demo's server (a
session of its own, which no terminal signal reaches) stops when the demo's process dies. Real
processes, real signals, bounded waits."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from demo.folder import create_team, prepare
from trainer.run.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.services, pytest.mark.timeout(600)]


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, from /proc."""
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def _tree(pid: int) -> dict[int, str]:
    """``pid`` and every descendant, each with its start time (a pid reused later is another process)."""
    children, seen, todo = _children(), {}, [pid]
    while todo:
        p = todo.pop()
        start = _start_time(p)
        if start is not None:
            seen[p] = start
            todo += children.get(p, [])
    return seen


def _start_time(pid: int) -> str | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]  # a zombie has exited


def _alive(tree: dict[int, str]) -> list[int]:
    return [p for p, start in tree.items() if _start_time(p) == start]


def _wait_gone(tree: dict[int, str], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := _alive(tree)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _cmdlines(pids: list[int]) -> list[str]:
    out = []
    for p in pids:
        with contextlib.suppress(OSError):
            out.append(Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
    return out


def _wait_ready(base: str, proc: subprocess.Popen[bytes], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("zenflow serve did not become ready")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, dict[str, str], Path]]:
    """``zenflow serve`` on embedded defaults as a terminal runs it: the leader of its process group."""
    env = {k: v for k, v in prepare(tmp_path / "var", fresh=True).items() if not k.startswith("ZENFLOW_")}
    env["ZENFLOW_DATA_DIR"] = str(tmp_path / "var")
    log = tmp_path / "serve.log"
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "api.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc, f"http://127.0.0.1:{port}", env, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_hangup_stops_the_server_and_its_jobs_processes(
    served: tuple[subprocess.Popen[bytes], str, dict[str, str], Path],
) -> None:
    proc, base, env, log = served
    _wait_ready(base, proc)
    _, key = create_team(env)
    auth = {"Authorization": f"Bearer {key}"}
    train = (ROOT / "trainer/samples/capitals_train.jsonl").read_bytes()
    up = httpx.post(
        f"{base}/v1/files", headers=auth, data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", train)}
    )
    assert up.status_code == 200, up.text
    job = httpx.post(
        f"{base}/v1/fine_tuning/jobs",
        headers=auth,
        json={"model": "tiny-llama", "training_file": up.json()["id"], "hyperparameters": {"n_epochs": 500}},
        timeout=60,
    )
    assert job.status_code == 200, job.text
    job_id = job.json()["id"]
    # the job runs: its runner is a descendant of the server, in a process group and session of its own
    deadline = time.monotonic() + 180
    while not any("worker.job.runner" in c for c in _cmdlines(list(_tree(proc.pid)))):
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    tree = _tree(proc.pid)
    own_groups = [p for p in tree if os.getpgid(p) != proc.pid]
    assert own_groups, "the job's processes lead groups of their own: the terminal's SIGHUP misses them"

    os.killpg(proc.pid, signal.SIGHUP)  # what closing the terminal does to its foreground job
    assert proc.wait(timeout=90) == 0, log.read_text()[-3000:]  # a clean stop, not SIGHUP's default death
    left = _wait_gone(tree, timeout=30)
    assert not left, f"outlived the server: {_cmdlines(left)}"
    text = log.read_text()
    assert "SIGHUP: shutting down" in text
    # re-queued once: checkpointed (exit code 75), or, when the hangup came while the runner was still
    # starting (a loaded box), stopped by the SIGTERM it had no handler for yet
    requeued = rf"job {job_id}: runner exited \((exit code 75|killed by SIGTERM)\): requeued"
    assert len(re.findall(requeued, text)) == 1, text[-3000:]
    assert text.count(f"job {job_id}: running on") == 1  # not started again while the worker stopped
    with sqlite3.connect(env["ZENFLOW_DATA_DIR"] + "/zenflow.db") as db:
        (status,) = db.execute("select status from fine_tuning_jobs where id = ?", (job_id,)).fetchone()
    assert status == "queued"  # for the next start


def test_the_demos_server_stops_when_the_demo_dies(tmp_path: Path) -> None:
    """``make run`` starts ``zenflow serve`` in a session of its own (its Ctrl-C is the demo's to give):
    the demo killed by its terminal's SIGHUP, the server gets SIGTERM from the kernel and stops."""
    script = tmp_path / "demo_like.py"
    script.write_text(
        "import sys, time\n"
        "from pathlib import Path\n"
        "from demo.folder import prepare\n"
        "from demo.server import Server\n"
        f"data = Path({str(tmp_path / 'var')!r})\n"
        "server = Server(prepare(data, fresh=True), data)\n"
        "server.wait_ready(180)\n"
        "print(server.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZENFLOW_")}
    env["PYTHONPATH"] = str(ROOT)
    demo = subprocess.Popen(
        [sys.executable, str(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE, start_new_session=True
    )
    server = 0
    try:
        assert demo.stdout is not None
        line = demo.stdout.readline()
        assert line.strip().isdigit(), line
        server = int(line)
        tree = _tree(server)
        assert os.getpgid(server) != demo.pid  # the terminal's signal does not reach it
        os.killpg(demo.pid, signal.SIGHUP)  # the demo dies (Python's default for SIGHUP)
        assert demo.wait(timeout=10) == -signal.SIGHUP
        left = _wait_gone(tree, timeout=60)
        assert not left, f"outlived the demo: {_cmdlines(left)}"
        serve_log = (tmp_path / "var" / "serve.log").read_text()
        assert "SIGTERM: shutting down" in serve_log  # its clean stop
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
        if server and _start_time(server) is not None:  # failed: leave no server behind
            os.killpg(server, signal.SIGKILL)
